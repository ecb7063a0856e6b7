// Pipeline schedules without communication: every schedule runs to the end
// with blocking receives (no deadlock), every forward precedes its backward,
// sends pair with receives, and activations in flight stay within the bound.

#include <gtest/gtest.h>

#include <climits>
#include <random>

#include "meshtrain/pp.h"
#include "meshtrain/util.h"

using namespace meshtrain;
using namespace meshtrain::pp;

namespace {

int bound(const ScheduleSpec& s, int rank) {
  if (s.kind == "naive") return 1;
  if (s.kind == "gpipe") return s.microbatches;
  if (s.kind == "1f1b") return std::min(s.ranks - rank, s.microbatches);
  // Interleaved: the warm-up forwards plus one.
  return std::min(s.microbatches * s.virtual_stages, (s.ranks - rank - 1) * 2 + (s.virtual_stages - 1) * s.ranks + 1);
}

}  // namespace

TEST(Schedules, EveryKindRunsToTheEndWithinItsActivationBound) {
  for (const char* kind : {"naive", "gpipe", "1f1b", "interleaved"}) {
    for (int p = 1; p <= 5; ++p) {
      for (int m = 1; m <= 8; ++m) {
        for (int v = 1; v <= (std::string(kind) == "interleaved" ? 3 : 1); ++v) {
          ScheduleSpec s{kind, p, m, v};
          if (s.kind == "interleaved" && m % p != 0) continue;
          auto sched = make_schedule(s);
          Replay r = replay(s, sched);
          ASSERT_TRUE(r.completes) << kind << " p=" << p << " m=" << m << " v=" << v << ": " << r.problem;
          for (int rank = 0; rank < p; ++rank) {
            EXPECT_LE(r.max_in_flight[rank], bound(s, rank))
                << kind << " p=" << p << " m=" << m << " v=" << v << " rank " << rank;
          }
        }
      }
    }
  }
}

TEST(Schedules, OneFOneBHoldsFewerActivationsThanGPipe) {
  ScheduleSpec g{"gpipe", 4, 8, 1}, f{"1f1b", 4, 8, 1};
  Replay rg = replay(g, make_schedule(g)), rf = replay(f, make_schedule(f));
  EXPECT_EQ(rg.max_in_flight[0], 8);
  EXPECT_EQ(rf.max_in_flight[0], 4);
  EXPECT_EQ(rf.max_in_flight[3], 1);
}

// What the global-batch balance loss of a mixture of experts needs: on
// every stage, the step's forwards before its first backward. GPipe always;
// 1F1B only where it has no steady state (one micro-batch, or one stage
// whose warm-up covers them all: never, its last rank has no warm-up);
// naive and interleaved not once a second micro-batch follows a backward.
TEST(Schedules, ForwardsBeforeBackwards) {
  for (int p = 1; p <= 4; ++p) {
    for (int m = 1; m <= 6; ++m) {
      EXPECT_TRUE(forwards_before_backwards({"gpipe", p, m, 1})) << "gpipe p=" << p << " m=" << m;
      EXPECT_EQ(forwards_before_backwards({"1f1b", p, m, 1}), m == 1) << "1f1b p=" << p << " m=" << m;
      EXPECT_EQ(forwards_before_backwards({"naive", p, m, 1}), m == 1) << "naive p=" << p << " m=" << m;
    }
  }
  EXPECT_FALSE(forwards_before_backwards({"interleaved", 2, 2, 2}));
  EXPECT_FALSE(forwards_before_backwards({"interleaved", 2, 4, 2}));
}

TEST(Schedules, PrintableAsText) {
  auto s = make_schedule({"1f1b", 2, 3, 1});
  EXPECT_EQ(to_string(s[0]), "0F0 send 0F0>1 0F1 send 0F1>1 recv 1B0<1 0B0 0F2 send 0F2>1 recv 1B1<1 0B1 recv 1B2<1 0B2");
  EXPECT_EQ(to_string(s[1]), "recv 0F0<0 1F0 1B0 send 1B0>0 recv 0F1<0 1F1 1B1 send 1B1>0 recv 0F2<0 1F2 1B2 send 1B2>0");
  auto n = make_schedule({"naive", 2, 1, 1});
  EXPECT_EQ(to_string(n[0]), "0F0 send 0F0>1 recv 1B0<1 0B0");
}

TEST(Schedules, ABrokenScheduleIsCaught) {
  ScheduleSpec s{"1f1b", 2, 2, 1};
  // Backward before forward on rank 0.
  auto bad = make_schedule(s);
  std::reverse(bad[0].begin(), bad[0].end());
  EXPECT_FALSE(replay(s, bad).completes);
  // A lost send: the receiver waits forever.
  auto lost = make_schedule(s);
  lost[0].erase(lost[0].begin() + 1);
  Replay r = replay(s, lost);
  EXPECT_FALSE(r.completes);
  EXPECT_NE(r.problem.find("deadlock"), std::string::npos) << r.problem;
}

TEST(Schedules, BadSpecsAreRejected) {
  EXPECT_THROW(make_schedule({"zigzag", 2, 2, 1}), ConfigError);
  EXPECT_THROW(make_schedule({"interleaved", 2, 3, 2}), ConfigError);  // m % p != 0
  EXPECT_THROW(make_schedule({"1f1b", 2, 2, 2}), ConfigError);         // V > 1 needs interleaved
}

TEST(Schedules, IdealBubble) {
  EXPECT_DOUBLE_EQ(ideal_bubble({"1f1b", 4, 8, 1}), 3.0 / 11.0);
  EXPECT_DOUBLE_EQ(ideal_bubble({"interleaved", 4, 8, 2}), 3.0 / 11.0 / 2);
  EXPECT_DOUBLE_EQ(ideal_bubble({"naive", 4, 1, 1}), 0.75);
}

// The textbook O(parts x n^2) dynamic programme, scanning every last cut left
// to right: the cuts partition_balanced must reproduce exactly (the trainer,
// the planner and saved layouts all cut by it).
std::vector<int64_t> reference_partition(const std::vector<int64_t>& costs, int parts) {
  const int n = static_cast<int>(costs.size());
  std::vector<int64_t> prefix(n + 1, 0);
  for (int i = 0; i < n; ++i) prefix[i + 1] = prefix[i] + costs[i];
  std::vector<std::vector<int64_t>> best(parts + 1, std::vector<int64_t>(n + 1, INT64_MAX));
  std::vector<std::vector<int>> cut(parts + 1, std::vector<int>(n + 1, 0));
  best[0][0] = 0;
  for (int k = 1; k <= parts; ++k)
    for (int i = k; i <= n; ++i)
      for (int j = k - 1; j < i; ++j) {
        if (best[k - 1][j] == INT64_MAX) continue;
        const int64_t v = std::max(best[k - 1][j], prefix[i] - prefix[j]);
        if (v < best[k][i]) best[k][i] = v, cut[k][i] = j;
      }
  std::vector<int64_t> bounds(parts + 1);
  bounds[parts] = n;
  for (int k = parts, i = n; k > 0; --k) bounds[k - 1] = i = cut[k][i];
  return bounds;
}

TEST(Partition, EqualsTheTextbookProgrammeOnRandomCostsAndIsFastOnDeepModels) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 400; ++trial) {
    const int n = 1 + static_cast<int>(rng() % 40);
    const int parts = 1 + static_cast<int>(rng() % n);
    const int64_t spread = trial % 4 == 0 ? 2 : 1000;  // many ties, or few
    std::vector<int64_t> costs(n);
    for (auto& c : costs) c = static_cast<int64_t>(rng() % spread) + (trial % 8 == 1 ? 0 : 1) * (rng() % 2);
    EXPECT_EQ(partition_balanced(costs, parts), reference_partition(costs, parts)) << "trial " << trial;
  }
  // 100,002 pieces (a 100,000-layer model) on 8 stages: the planner's case.
  std::vector<int64_t> deep(100002, 5);
  deep.front() = deep.back() = 40;
  const auto bounds = partition_balanced(deep, 8);
  EXPECT_EQ(bounds.front(), 0);
  EXPECT_EQ(bounds.back(), 100002);
  EXPECT_THROW(partition_balanced({1, -1}, 1), ConfigError);
}

TEST(Partition, BalancedContiguousStages) {
  EXPECT_EQ(partition_balanced({1, 1, 1, 1}, 2), (std::vector<int64_t>{0, 2, 4}));
  EXPECT_EQ(partition_balanced({10, 1, 1, 1, 1, 10}, 3), (std::vector<int64_t>{0, 1, 5, 6}));
  auto b = partition_balanced({3, 3, 3, 3, 3}, 2);  // 5 layers on 2 stages
  EXPECT_EQ(b.front(), 0);
  EXPECT_EQ(b.back(), 5);
  EXPECT_TRUE(b[1] == 2 || b[1] == 3);
  EXPECT_THROW(partition_balanced({1, 2}, 3), ConfigError);
  EXPECT_EQ(meshtrain::pp::partition_explicit({1, 5}, 7, 3), (std::vector<int64_t>{0, 1, 5, 7}));
  EXPECT_THROW(meshtrain::pp::partition_explicit({5, 1}, 7, 3), ConfigError);
  EXPECT_THROW(meshtrain::pp::partition_explicit({1}, 7, 3), ConfigError);
}
