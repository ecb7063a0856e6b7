// Training across hosts on the hierarchical backend, two "hosts" of two ranks
// on loopback (MESHTRAIN_HOST_ID): every layout still trains like one
// process, and of each gradient all-reduce only each local rank's slice
// crosses hosts (2(H-1)/H of the buffer per host, H = 2).

#include <gtest/gtest.h>

#include "equivalence.h"
#include "meshtrain/models.h"
#include "util/shard.h"

using meshtrain::testing::RankOptions;

namespace {

RankOptions two_hosts() {
  RankOptions o;
  o.hosts = 2;  // ranks 0-1 on one, 2-3 on the other
  o.env.push_back("MESHTRAIN_HIER_MIN_KB=0");  // the tiny model's buckets take the hierarchical path too
  return o;
}

TEST(Hierarchical, TwoHostsTrainLikeOneProcess) {
  struct Layout {
    int dp, pp, zero;
  };
  // dp 4: world and data axis hierarchical; dp 2 x pp 2: the pipeline inside
  // each host, the data axis across (one rank per host: Gloo).
  for (const Layout& l : {Layout{4, 1, 0}, Layout{4, 1, 2}, Layout{2, 2, 1}}) {
    auto c = meshtrain::testing::tiny_gpt();
    c.dp = l.dp;
    c.pp = l.pp;
    c.zero = l.zero;
    if (l.pp > 1) c.microbatches = 4;
    SCOPED_TRACE("dp " + std::to_string(l.dp) + " x pp " + std::to_string(l.pp) + ", ZeRO " + std::to_string(l.zero));
    meshtrain::testing::expect_trains_like_one_process(c, 4, {}, two_hosts());
  }
}

TEST(Hierarchical, OnlyEachLocalSliceOfTheGradientsCrossesHosts) {
  auto c = meshtrain::testing::tiny_gpt();
  c.dp = 4;
  c.bucket_cap_mb = 100;  // one bucket: one all-reduce of every gradient per step
  c.overlap = false;
  const auto m = meshtrain::testing::metrics_on_ranks(c, 4, two_hosts());
  if (meshtrain::testing::in_rank_process() || ::testing::Test::HasFailure()) return;
  const int64_t params = meshtrain::models::parameter_count(meshtrain::train::resolve(c, 4).model);
  for (int r = 0; r < 4; ++r) {
    const auto& all_reduce = m["ranks"][r]["traffic"]["all_reduce"];
    // This rank's slice (local rank r % 2 of 2), all-reduced with the other
    // host's: a ring of two sends it once and receives it once.
    const double slice = 4.0 * meshtrain::shard_size(params, 2, r % 2);
    EXPECT_DOUBLE_EQ(all_reduce["inter_host_sent"].num(), slice) << "rank " << r;
    EXPECT_DOUBLE_EQ(all_reduce["inter_host_received"].num(), slice) << "rank " << r;
    // Inside the host: the reduce-scatter sends the other slice, the
    // all-gather this rank's slice.
    EXPECT_DOUBLE_EQ(all_reduce["bytes_sent"].num(), 4.0 * params + slice) << "rank " << r;
  }
}

}  // namespace
