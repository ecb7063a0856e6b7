// The shared-memory backend's one-step threshold (Note [Measured one-step
// threshold] in src/comm/shm/one_step.h): with nothing cached the ranks
// measure both algorithms when the communicator is made and every rank takes
// the same threshold; the next job reads the figures from the cache and
// chooses the same; MESHTRAIN_SHM_SMALL_KB overrides it. On either side of
// the threshold an all-reduce adds the ranks' tensors in rank order, bit for
// bit what one process computes, so the measured choice never changes a result.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <stdlib.h>

#include <cstdlib>
#include <fstream>
#include <memory>

#include "harness.h"

using meshtrain::comm::Communicator;
using meshtrain::testing::RankOptions;
using meshtrain::testing::run_ranks;

namespace {

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// A fresh directory for the cache, removed at the end of the test.
struct CacheDir {
  std::string path;
  CacheDir() {
    char tmpl[] = "/tmp/meshtrain-cache-XXXXXX";
    path = ::mkdtemp(tmpl);
  }
  ~CacheDir() { std::system(("rm -rf " + path).c_str()); }
};

// "shm one step up to 16 KiB on 3 ranks (...)" -> 16; -1 without such a line.
int64_t threshold_kib(const std::string& tuning) {
  const std::string prefix = "shm one step up to ";
  const auto at = tuning.find(prefix);
  return at == std::string::npos ? -1 : std::stoll(tuning.substr(at + prefix.size()));
}

// Rank r's values: magnitudes from 2^-20 to 2^20, so that another order of the additions shows.
torch::Tensor values_of(int rank, int64_t numel) {
  torch::manual_seed(77 + rank);
  return torch::randn({numel}) * torch::pow(2.0, torch::randint(-20, 20, {numel}).to(torch::kFloat));
}

void threshold_is_agreed_and_sums_are_in_rank_order(Communicator& comm) {
  const int n = comm.size(), r = comm.rank();
  const std::string tuning = comm.tuning(), expect = std::getenv("ONE_STEP_EXPECT");
  const int64_t kib = threshold_kib(tuning);
  ASSERT_EQ(comm.backend(), "shm");
  ASSERT_TRUE(kib >= 4 && kib <= 256 && (kib & (kib - 1)) == 0) << tuning;  // one of the sizes measured
  for (const auto& t : comm.all_gather(torch::tensor({kib}, torch::kLong))) {
    EXPECT_EQ(t.item<int64_t>(), kib) << "rank " << r << ": " << tuning;
  }
  if (expect == "measured") {  // every rank measured and describes the figures
    EXPECT_TRUE(contains(tuning, "all_reduce, us one step / chunked: 4K ") && !contains(tuning, "(cached)")) << tuning;
  } else if (expect == "cached") {
    EXPECT_TRUE(contains(tuning, r == 0 ? "(cached)" : "(rank 0's choice)")) << tuning;
    EXPECT_EQ(kib, std::stoll(std::getenv("ONE_STEP_KIB"))) << "the cached figures chose another threshold";
  } else {
    EXPECT_EQ(kib, std::stoll(expect)) << tuning;
    EXPECT_TRUE(contains(tuning, r == 0 ? "(MESHTRAIN_SHM_SMALL_KB)" : "(rank 0's choice)")) << tuning;
  }
  // Both sides of the threshold and far from it: one step, chunks, several chunks.
  for (int64_t numel : {kib * 256, kib * 256 + 1, int64_t{1000}, int64_t{200003}}) {
    torch::Tensor t = values_of(r, numel);
    comm.all_reduce(t);
    torch::Tensor want = values_of(0, numel);
    for (int q = 1; q < n; ++q) want = want + values_of(q, numel);
    EXPECT_TRUE(torch::equal(t, want)) << numel << " floats, threshold " << kib << " KiB";
  }
  if (r == 0) std::ofstream(meshtrain::testing::shared_dir() + "/kib") << kib;
}

RankOptions with_cache_in(const std::string& dir, const std::string& expect) {
  RankOptions o;
  o.env = {"MESHTRAIN_BACKEND=shm", "TMPDIR=" + dir, "ONE_STEP_EXPECT=" + expect};
  return o;
}

TEST(SharedMemoryTuning, OneStepThresholdIsMeasuredAgreedCachedOrSet) {
  // A cache of its own, empty: the first job measures. The parent makes it
  // (a rank reruns this body and leaves inside run_ranks; its TMPDIR came from the parent).
  const std::unique_ptr<CacheDir> dir(meshtrain::testing::in_rank_process() ? nullptr : new CacheDir);
  const std::string cache = dir ? dir->path : "";
  std::string measured;
  {
    auto run = run_ranks(3, threshold_is_agreed_and_sums_are_in_rank_order, with_cache_in(cache, "measured"));
    std::ifstream(run.file("kib")) >> measured;
  }
  if (dir) {  // in a rank of a later job, the first call returned at once
    ASSERT_FALSE(measured.empty());
  }
  RankOptions cached = with_cache_in(cache, "cached");
  cached.env.push_back("ONE_STEP_KIB=" + measured);
  run_ranks(3, threshold_is_agreed_and_sums_are_in_rank_order, cached);
  RankOptions set = with_cache_in(cache, "8");
  set.env.push_back("MESHTRAIN_SHM_SMALL_KB=8");
  run_ranks(3, threshold_is_agreed_and_sums_are_in_rank_order, set);
}

}  // namespace
