// Elastic runs, pure parts: when node 0 closes a round, who the members are,
// meshrun's --nnodes MIN:MAX, and the trainer's layout for each world size.

#include <gtest/gtest.h>

#include "config_error.h"

#include "app/launch/elastic.h"
#include "app/launch/launcher.h"
#include "app/trainer/config.h"
#include "app/trainer/elastic.h"
#include "meshtrain/util.h"
#include "meshtrain/version.h"

using namespace meshtrain;
using launch::NodeEntry;
using launch::RoundState;
constexpr auto config_error = meshtrain::testing::config_error_of;

namespace {

RoundState state(int joined, int alive_not_joined, double elapsed, bool first_round) {
  RoundState s;
  s.joined = joined;
  s.alive_not_joined = alive_not_joined;
  s.elapsed_seconds = elapsed;
  s.first_round = first_round;
  return s;
}


}  // namespace

TEST(RankEnvironment, ThreadsAreTheRanksShareAndOpenMpWaitsPassively) {
  launch::LaunchOptions o;
  o.nproc_per_node = 2;
  auto env = launch::rank_environment(o, 1, 0, 29500, 8, {});
  EXPECT_EQ(env.at("OMP_NUM_THREADS"), "4");
  EXPECT_EQ(env.at("OPENBLAS_NUM_THREADS"), "4");
  EXPECT_EQ(env.at("OMP_WAIT_POLICY"), "PASSIVE");
  // The user's own settings stay.
  env = launch::rank_environment(o, 1, 0, 29500, 8, {{"OMP_WAIT_POLICY", "ACTIVE"}, {"OMP_NUM_THREADS", "3"}});
  EXPECT_EQ(env.at("OMP_WAIT_POLICY"), "ACTIVE");
  EXPECT_EQ(env.at("OMP_NUM_THREADS"), "3");
  EXPECT_EQ(env.at("OPENBLAS_NUM_THREADS"), "4");
}

TEST(ElasticRound, ClosesAtMaxOrAfterTheLastCallOrWhenEveryLiveNodeIsIn) {
  const double last_call = 10;
  EXPECT_TRUE(launch::round_can_close(state(2, 0, 0, true), 1, 2, last_call));   // MAX
  EXPECT_FALSE(launch::round_can_close(state(1, 0, 0, true), 1, 2, last_call));  // first round: wait for more
  EXPECT_TRUE(launch::round_can_close(state(1, 0, 10, true), 1, 2, last_call));  // ... until the last call
  EXPECT_FALSE(launch::round_can_close(state(0, 0, 99, true), 1, 2, last_call));  // never below MIN
  EXPECT_FALSE(launch::round_can_close(state(1, 0, 99, false), 2, 3, last_call));
  // After the first round the survivors meet at once, but wait for a live node still stopping its ranks.
  EXPECT_TRUE(launch::round_can_close(state(1, 0, 0, false), 1, 2, last_call));
  EXPECT_FALSE(launch::round_can_close(state(1, 1, 0, false), 1, 2, last_call));
  EXPECT_TRUE(launch::round_can_close(state(1, 1, 10, false), 1, 2, last_call));
  // MAX newcomers do not close the round while a member of the previous one is still on its way.
  RoundState full = state(2, 1, 0, false);
  full.previous_missing = 1;
  EXPECT_FALSE(launch::round_can_close(full, 1, 2, last_call));
  full.elapsed_seconds = 10;
  EXPECT_TRUE(launch::round_can_close(full, 1, 2, last_call));
}

TEST(ElasticRound, MembersAreLiveDistinctNodesWithNodeZeroAlwaysIn) {
  const std::vector<NodeEntry> joined = {{2, 5}, {1, 3}, {0, 1}, {1, 6}, {3, 4}};
  // Dead incarnation 3 (node 1's first meshrun) is out, node 1's second is in; ordered by node.
  EXPECT_EQ(launch::choose_members(joined, {3}, 4), (std::vector<NodeEntry>{{0, 1}, {1, 6}, {2, 5}, {3, 4}}));
  // A node id that joined twice is kept once, at its first arrival.
  EXPECT_EQ(launch::choose_members(joined, {}, 4), (std::vector<NodeEntry>{{0, 1}, {1, 3}, {2, 5}, {3, 4}}));
  // At most MAX, node 0 first although it arrived third, then arrival order.
  EXPECT_EQ(launch::choose_members(joined, {}, 2), (std::vector<NodeEntry>{{0, 1}, {2, 5}}));
  // The previous round's members come before newcomers that arrived first.
  EXPECT_EQ(launch::choose_members(joined, {}, 2, {{0, 1}, {3, 4}}), (std::vector<NodeEntry>{{0, 1}, {3, 4}}));
  EXPECT_EQ(launch::decode_members(launch::encode_members(joined)), joined);
  EXPECT_NE(config_error([] { launch::decode_members("0#1,1"); }).find("malformed member '1'"), std::string::npos);
  EXPECT_NE(config_error([] { launch::decode_members("0#x"); }).find("malformed incarnation 'x'"), std::string::npos);
}

TEST(ElasticLaunchArgs, NnodesMinMax) {
  auto o = launch::parse_launch_args({"--nnodes", "1:3", "--master-port", "29500", "--", "true"});
  EXPECT_TRUE(o.elastic);
  EXPECT_EQ(o.min_nodes, 1);
  EXPECT_EQ(o.nnodes, 3);
  o = launch::parse_launch_args({"--nnodes", "2", "--master-port", "29500", "--", "true"});
  EXPECT_FALSE(o.elastic);
  EXPECT_EQ(o.min_nodes, 2);
  EXPECT_NE(config_error([] { launch::parse_launch_args({"--nnodes", "3:2", "--", "true"}); })
                .find("--nnodes 3:2 needs 1 <= MIN <= MAX"),
            std::string::npos);
  EXPECT_NE(config_error([] { launch::parse_launch_args({"--nnodes", "1:2", "--master-port", "0", "--", "true"}); })
                .find("needs a --master-port"),
            std::string::npos);
  o = launch::parse_launch_args({"--nnodes", "1:2", "--rdzv-last-call", "3", "--master-port", "1", "--", "true"});
  EXPECT_EQ(o.last_call.count(), 3000);
}

TEST(ElasticLayouts, ParsedAndCheckedPerWorldSize) {
  const auto layouts = train::parse_elastic_layouts("4:dp2xpp2,2:tp2xzero0,1:dp1");
  ASSERT_EQ(layouts.size(), 3u);
  EXPECT_EQ(layouts[0].world, 4);
  EXPECT_EQ(layouts[0].dp * 10 + layouts[0].pp, 22);
  EXPECT_EQ(layouts[0].zero, -1);  // the flags' stage
  EXPECT_EQ(layouts[1].tp, 2);
  EXPECT_EQ(layouts[1].dp, 1);
  EXPECT_EQ(layouts[1].zero, 0);
  EXPECT_NE(config_error([] { train::parse_elastic_layouts("4:dp2"); }).find("'4:dp2' is dp 2 x pp 1 x tp 1 = 2 ranks, not 4"),
            std::string::npos);
  EXPECT_NE(config_error([] { train::parse_elastic_layouts("4dp4"); }).find("needs WORLD:LAYOUT"), std::string::npos);
  EXPECT_NE(config_error([] { train::parse_elastic_layouts("2:dp2xcp1"); }).find("the axis 'cp'"), std::string::npos);
  EXPECT_NE(config_error([] { train::parse_elastic_layouts("2:dp2,2:tp2"); }).find("2 is given twice"), std::string::npos);
  EXPECT_NE(config_error([] { train::parse_elastic_layouts("2:dp2xzero4"); }).find("not a ZeRO stage"), std::string::npos);
}

TEST(ElasticLayouts, ChosenForTheWorldSize) {
  const int64_t memory = int64_t{4} << 30;
  const auto flags = train::parse_train_args({"--model", "gpt", "--dp", "2", "--pp", "2", "--microbatches", "4",
                                              "--global-batch", "8", "--elastic-layouts", "2:tp2"});
  // The flags' layout where it fits.
  auto choice = train::resolve_for_world(flags, 4, true, memory);
  EXPECT_EQ(choice.source, "the flags");
  EXPECT_EQ(choice.config.microbatches, 4);
  // The user's entry: the flags' micro-batches belong to the flags' layout.
  choice = train::resolve_for_world(flags, 2, true, memory);
  EXPECT_EQ(choice.source, "--elastic-layouts");
  EXPECT_EQ(choice.config.tp * 10 + choice.config.dp, 21);
  EXPECT_EQ(choice.config.microbatches, 0);
  EXPECT_EQ(choice.config.global_batch, 8);
  // Neither: the planner's best layout that the trainer can run, under an elastic meshrun only.
  choice = train::resolve_for_world(flags, 1, true, memory);
  EXPECT_EQ(choice.source, "the planner");
  EXPECT_EQ(choice.config.dp * choice.config.pp * choice.config.tp, 1);
  EXPECT_EQ(choice.config.global_batch, 8);
  choice = train::resolve_for_world(flags, 8, true, memory);
  EXPECT_EQ(choice.source, "the planner");
  EXPECT_EQ(8 % choice.config.dp, 0);
  EXPECT_EQ(choice.config.dp * choice.config.pp * choice.config.tp, 8);
  EXPECT_NE(config_error([&] { train::resolve_for_world(flags, 1, false, memory); }).find("does not match the world size 1"),
            std::string::npos);
  // 3 ranks: dp 3 does not divide the global batch of 8, tp 3 not the 4 heads, and pp 3's derived 3
  // micro-batches not the 8 samples: the error says how to give a layout.
  const auto small = train::parse_train_args({"--model", "gpt", "--layers", "1", "--global-batch", "8"});
  EXPECT_NE(config_error([&] { train::resolve_for_world(small, 3, true, memory); }).find("--elastic-layouts 3:dp3"),
            std::string::npos);
}

// Issue 54, item 6 (Note [Nodes agree] in app/launch/launcher.cpp): what the
// nodes compare, and how a difference is said: the node, the flag, both
// values and the fix, for each setting that differs; nothing when they agree.
TEST(NodeSettings, EveryDifferenceIsNamedWithBothValuesAndTheFix) {
  auto options = [](std::vector<std::string> args) {
    args.insert(args.end(), {"--", "true"});
    return launch::parse_launch_args(args);
  };
  launch::LaunchOptions node0 = options({"--nnodes", "2", "--nproc-per-node", "2"});
  node0.rdzv_token = "0123456789abcdef";
  launch::LaunchOptions node1 = node0;
  node1.node_rank = 1;
  node1.rdzv_token_origin = "--rdzv-token-file /elsewhere";  // where it came from is not compared
  const std::string zero = launch::node_settings(node0);
  EXPECT_EQ(launch::node_settings_difference(launch::node_settings(node1), zero, 1), "");

  node1.nproc_per_node = 1;
  node1.max_restarts = 3;
  EXPECT_EQ(launch::node_settings_difference(launch::node_settings(node1), zero, 1),
            "node 1's meshrun has --nproc-per-node 1 and node 0's has --nproc-per-node 2: start every node's meshrun "
            "with the same --nproc-per-node; node 1's meshrun has --max-restarts 3 and node 0's has --max-restarts 0: "
            "start every node's meshrun with the same --max-restarts");

  launch::LaunchOptions elastic = options({"--nnodes", "1:2", "--nproc-per-node", "2", "--node-rank", "1",
                                           "--master-port", "29500"});
  elastic.rdzv_token = "0123456789abcdef";
  EXPECT_NE(launch::node_settings_difference(launch::node_settings(elastic), zero, 1)
                .find("node 1's meshrun has --nnodes 1:2 and node 0's has --nnodes 2: start every node's meshrun with "
                      "the same --nnodes"),
            std::string::npos);

  launch::LaunchOptions untokened = node0;
  untokened.rdzv_token.clear();
  EXPECT_EQ(launch::node_settings_difference(zero, launch::node_settings(untokened), 3),
            "node 3's meshrun has a rendezvous token (MESHTRAIN_RDZV_TOKEN) and node 0's has no rendezvous token: give "
            "every node the same --rdzv-token-file (or MESHTRAIN_RDZV_TOKEN), node 0 too, or none anywhere");

  std::string older = zero;
  older.replace(older.find("version\t"), std::string::npos, "version\t0.0.1\tmeshtrain 0.0.1\n");
  EXPECT_EQ(launch::node_settings_difference(zero, older, 1),
            str_cat("node 1's meshrun has meshtrain ", version(), " and node 0's has meshtrain 0.0.1: install the same "
                    "meshtrain version on every node"));
  // A record of another version that lacks a setting: only the version is said.
  EXPECT_EQ(launch::node_settings_difference(zero, "version\t0.0.1\tmeshtrain 0.0.1\n", 1),
            launch::node_settings_difference(zero, older, 1));
}
