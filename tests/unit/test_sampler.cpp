// The seeded window permutation and the data-parallel sampler (meshtrain/data.h):
// pure functions, no processes.

#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <set>

#include "config_error.h"
#include "meshtrain/data.h"

using meshtrain::data::DistributedSampler;
using meshtrain::data::DistributedSamplerOptions;
using meshtrain::data::Permutation;
using meshtrain::data::sample_at;
using meshtrain::testing::config_error_of;

namespace {

std::vector<int64_t> image(const Permutation& p) {
  std::vector<int64_t> out;
  for (int64_t i = 0; i < p.size(); ++i) out.push_back(p(i));
  return out;
}

bool is_permutation_of_range(std::vector<int64_t> v) {
  std::sort(v.begin(), v.end());
  for (size_t i = 0; i < v.size(); ++i)
    if (v[i] != static_cast<int64_t>(i)) return false;
  return true;
}

}  // namespace

// Every size, including 1, powers of two and their neighbours (where cycle
// walking does the most and the least), maps [0, n) onto itself.
TEST(Permutation, IsABijectionOfEverySize) {
  std::vector<int64_t> sizes;
  for (int64_t n = 1; n <= 300; ++n) sizes.push_back(n);
  for (int64_t n : {511, 512, 513, 1023, 4096, 4097, 65535, 65537, 100003}) sizes.push_back(n);
  for (int64_t n : sizes) {
    for (uint64_t seed : {0ull, 1ull, 1234ull}) {
      EXPECT_TRUE(is_permutation_of_range(image(Permutation(n, seed, 0)))) << "size " << n << " seed " << seed;
    }
  }
}

TEST(Permutation, IsDeterministicAndDiffersPerEpochAndSeed) {
  const int64_t n = 1000;
  const auto a = image(Permutation(n, 1234, 0));
  EXPECT_EQ(a, image(Permutation(n, 1234, 0)));  // a function of (size, seed, epoch) alone
  const auto other_epoch = image(Permutation(n, 1234, 1)), other_seed = image(Permutation(n, 1235, 0));
  EXPECT_NE(a, other_epoch);
  EXPECT_NE(a, other_seed);
  EXPECT_NE(other_epoch, other_seed);
  // Shuffled, not a rotation or the identity: few fixed points and neighbours
  // scattered (a random permutation has about 1 fixed point and n/(n-1)
  // neighbours mapped to neighbours; allow ten times that).
  int fixed = 0, adjacent = 0;
  for (int64_t i = 0; i < n; ++i) {
    fixed += a[i] == i;
    if (i + 1 < n) adjacent += std::abs(a[i + 1] - a[i]) == 1;
  }
  EXPECT_LE(fixed, 10);
  EXPECT_LE(adjacent, 20);
  // Positions agree between two epochs no more than chance (n / n = 1 expected).
  int same = 0;
  for (int64_t i = 0; i < n; ++i) same += a[i] == other_epoch[i];
  EXPECT_LE(same, 10);
}

TEST(Permutation, RefusesOutOfRangeIndices) {
  EXPECT_NE(config_error_of([] { Permutation(10, 0, 0)(10); }).find("index 10 is outside [0, 10)"), std::string::npos);
  EXPECT_NE(config_error_of([] { Permutation(0, 0, 0); }).find("size 0 must be at least 1"), std::string::npos);
}

// Positions run through epochs: each epoch visits every sample once, in its
// own order; in order, position p reads p mod n.
TEST(Sampler, SampleAtVisitsEverySampleOncePerEpoch) {
  const int64_t n = 37;
  for (int64_t epoch = 0; epoch < 3; ++epoch) {
    std::vector<int64_t> seen;
    for (int64_t p = epoch * n; p < (epoch + 1) * n; ++p) seen.push_back(sample_at(p, n, 7, true));
    EXPECT_TRUE(is_permutation_of_range(seen)) << "epoch " << epoch;
    EXPECT_EQ(seen, image(Permutation(n, 7, epoch)));
  }
  for (int64_t p = 0; p < 3 * n; ++p) EXPECT_EQ(sample_at(p, n, 7, false), p % n);
}

// Global order, then split: the dp ranks' slices, concatenated in rank order,
// are the global batch, and every rank computes the same global batch.
TEST(Sampler, RankSlicesConcatenateToTheGlobalBatch) {
  const int64_t n = 50, G = 12;
  for (int dp : {1, 2, 3, 4, 6}) {
    for (int64_t step = 0; step < 12; ++step) {  // 12 x 12 = 144 samples: into epoch 2, batches crossing epochs
      std::vector<int64_t> joined;
      for (int r = 0; r < dp; ++r) {
        DistributedSampler s(n, DistributedSamplerOptions().global_batch(G).dp_size(dp).dp_rank(r).seed(99));
        EXPECT_EQ(s.global_batch(step), DistributedSampler(n, DistributedSamplerOptions().global_batch(G).seed(99))
                                            .global_batch(step));
        const auto mine = s.local_batch(step);
        EXPECT_EQ(static_cast<int64_t>(mine.size()), G / dp);
        joined.insert(joined.end(), mine.begin(), mine.end());
      }
      const DistributedSampler one(n, DistributedSamplerOptions().global_batch(G).seed(99));
      EXPECT_EQ(joined, one.global_batch(step)) << "dp " << dp << " step " << step;
    }
  }
}

// Step k's samples are positions [kG, (k+1)G): a batch that crosses an epoch
// takes the rest from the next epoch's order; the position is the step alone
// (resuming at step k reads what an uninterrupted run reads).
TEST(Sampler, StepsArePositionsAcrossEpochs) {
  const int64_t n = 10, G = 4;
  const DistributedSampler s(n, DistributedSamplerOptions().global_batch(G).seed(3));
  const auto step2 = s.global_batch(2);  // positions 8..11: two of epoch 0, two of epoch 1
  EXPECT_EQ(step2[0], Permutation(n, 3, 0)(8));
  EXPECT_EQ(step2[1], Permutation(n, 3, 0)(9));
  EXPECT_EQ(step2[2], Permutation(n, 3, 1)(0));
  EXPECT_EQ(step2[3], Permutation(n, 3, 1)(1));
  EXPECT_EQ(s.epoch_of(2), 0);
  EXPECT_EQ(s.epoch_of(3), 1);
  const DistributedSampler ordered(n, DistributedSamplerOptions().global_batch(G).shuffle(false));
  EXPECT_EQ(ordered.global_batch(2), (std::vector<int64_t>{8, 9, 0, 1}));
}

TEST(Sampler, RefusesLayoutsThatDoNotSplitTheBatch) {
  EXPECT_NE(config_error_of([] { DistributedSampler(10, DistributedSamplerOptions().global_batch(10).dp_size(4)); })
                .find("global_batch 10 must be a positive multiple of dp_size 4"),
            std::string::npos);
  EXPECT_NE(config_error_of([] { DistributedSampler(10, DistributedSamplerOptions().dp_size(2).dp_rank(2).global_batch(2)); })
                .find("dp_rank 2 is outside [0, dp_size 2)"),
            std::string::npos);
  EXPECT_NE(config_error_of([] { DistributedSampler(0, DistributedSamplerOptions()); }).find("0 samples"),
            std::string::npos);
}
