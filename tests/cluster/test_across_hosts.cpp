// Every strategy across hosts trains like one process (the equivalence
// contract, issue 30 item 1): meshrun nodes on test hosts (network namespaces,
// tests/cluster/hosts.sh), 2 hosts of 2 ranks (the hierarchical backend:
// shared memory inside a host, Gloo between), 4 hosts of 1 rank (flat Gloo:
// every axis crosses hosts), 8 ranks on 2 and 4 hosts, and 3 hosts (odd sizes,
// ZeRO shards that do not divide evenly). Built twice, as the equivalence
// matrix is: into cluster_tests with a sample (one case a strategy family),
// into cluster_full_tests (MESHTRAIN_FULL_CLUSTER) with the whole product.
// With MESHTRAIN_STRATEGY_TABLE=FILE each case appends its row of a markdown
// table there (tests/cluster/strategy_table.sh puts it into docs/launch.md).
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <ostream>
#include <stdexcept>
#include <string>
#include <vector>

#include "../dist/metrics.h"
#include "../dist/shell.h"
#include "cluster.h"
#include "meshtrain/util.h"

using meshtrain::str_cat;
using meshtrain::json::Value;
using meshtrain::testing::contains;
using meshtrain::testing::expect_same_losses;
using meshtrain::testing::Hosts;
using meshtrain::testing::kBin;
using meshtrain::testing::kTiny;
using meshtrain::testing::run_job;
using meshtrain::testing::sh;
using meshtrain::testing::Shell;
using meshtrain::testing::TempDir;

namespace {

constexpr int kSteps = 8;

struct Strategy {
  const char* name;
  const char* flags;  // for 4 ranks unless `ranks` says otherwise
  int ranks = 4;
};

struct Layout {
  Strategy strategy;
  int hosts, per_host;
  std::string name() const { return str_cat(strategy.name, "_on_", hosts, "x", per_host); }
  // What --backend auto picks: hierarchical where a host holds several ranks.
  const char* backend() const { return per_host > 1 ? "hierarchical" : "gloo"; }
};

void PrintTo(const Layout& l, std::ostream* os) { *os << l.name(); }

// The strategies of 4 ranks: the data axis (the article's master DP, DDP,
// ZeRO 1-3), the pipeline schedules (with dp 2, and 4 stages), tensor
// parallelism (with sequence parallelism, across 4 ranks, with a pipeline).
const std::vector<Strategy>& four_rank_strategies() {
  static const std::vector<Strategy> s = {
      {"master_dp", "--dp 4 --strategy dp"},
      {"ddp", "--dp 4"},
      {"zero1", "--dp 4 --zero 1"},
      {"zero2", "--dp 4 --zero 2"},
      {"zero3", "--dp 4 --zero 3"},
      {"dp2_pp2_naive", "--dp 2 --pp 2 --schedule naive"},
      {"dp2_pp2_gpipe_zero3", "--dp 2 --pp 2 --schedule gpipe --zero 3"},
      {"dp2_pp2_1f1b_zero1", "--dp 2 --pp 2 --schedule 1f1b --zero 1"},
      {"dp2_pp2_interleaved", "--dp 2 --pp 2 --schedule interleaved --virtual-stages 2"},
      {"pp4_1f1b", "--pp 4"},
      {"dp2_tp2", "--dp 2 --tp 2"},
      {"dp2_tp2_sp_zero2", "--dp 2 --tp 2 --sequence-parallel --zero 2"},
      {"tp4", "--tp 4"},
      {"pp2_tp2", "--pp 2 --tp 2"},
  };
  return s;
}

std::vector<Layout> layouts() {
#ifdef MESHTRAIN_FULL_CLUSTER
  std::vector<Layout> out;
  for (const Strategy& s : four_rank_strategies()) {
    out.push_back({s, 2, 2});
    out.push_back({s, 4, 1});
  }
  const Strategy three_d{"dp2_pp2_tp2_zero1", "--dp 2 --pp 2 --tp 2 --zero 1", 8};
  out.push_back({three_d, 2, 4});
  out.push_back({three_d, 4, 2});
  out.push_back({{"zero3", "--dp 3 --zero 3", 3}, 3, 1});  // 53,440 parameters in 3 uneven shards
  out.push_back({{"dp3_pp2_gpipe", "--dp 3 --pp 2 --schedule gpipe", 6}, 3, 2});
  out.push_back({{"zero2", "--dp 6 --zero 2", 6}, 3, 2});
  return out;
#else
  auto pick = [](const char* name) {
    for (const Strategy& s : four_rank_strategies())
      if (std::string(s.name) == name) return s;
    throw std::logic_error(str_cat("no strategy ", name));
  };
  return {{pick("ddp"), 2, 2},          {pick("zero3"), 2, 2},   {pick("dp2_pp2_gpipe_zero3"), 2, 2},
          {pick("dp2_pp2_interleaved"), 2, 2}, {pick("dp2_tp2"), 2, 2}, {pick("pp2_tp2"), 4, 1}};
#endif
}

const std::string kCommon = kTiny + str_cat("--steps ", kSteps, " --log-every 100 ");

// One process's metrics, trained once for every case of the binary.
const Value& one_process() {
  static const Value metrics = [] {
    TempDir t;
    Shell one = sh(kBin + "/meshtrain" + kCommon + "--metrics-out " + t.file("one.json"));
    MESHTRAIN_CHECK(one.exit_code == 0, "one process failed:\n", one.output);
    return meshtrain::json::parse_file(t.file("one.json"));
  }();
  return metrics;
}

// The largest |got - want| / |want| over the steps of one series.
double max_relative_difference(const Value& got, const Value& want, const char* series) {
  double worst = 0;
  for (size_t s = 0; s < std::min(got[series].size(), want[series].size()); ++s)
    worst = std::max(worst, std::abs(got[series][s].num() - want[series][s].num()) / std::abs(want[series][s].num()));
  return worst;
}

// Bytes per step every rank sent to other hosts on one mesh axis (or all,
// with the verification rows: inter_host_bytes_sent in cluster.h).
double inter_host_bytes(const Value& m, const std::string& axis) {
  if (axis == "all") return meshtrain::testing::inter_host_bytes_sent(m);
  double sum = 0;
  for (size_t i = 0; i < m["ranks"].size(); ++i) {
    const Value& rank = m["ranks"][i];
    if (rank.has("traffic_by_axis") && rank["traffic_by_axis"].has(axis))  // the master DP's metrics have none
      sum += rank["traffic_by_axis"][axis]["inter_host"]["bytes_sent"].num();
  }
  return sum;
}

// Note [Data-axis bytes across hosts]
// Data parallelism alone (no pp, tp) on n ranks, H hosts of L, S gradient
// bytes; what all ranks send to other hosts per step:
//   DDP, flat Gloo: 2 (n - L) S (Note [Cross-host bytes] in test_cross_host_bytes.cpp);
//   DDP, hierarchical: 2 (H - 1) S, L times fewer;
//   ZeRO-1/2: a reduce-scatter of the gradients and an all-gather of the
//     parameters, each (n - L) S flat; hierarchical nests both (Note [Nested
//     reduce-scatter and all-gather] in src/comm/hier/communicator.cpp), each
//     (H - 1) S: 2 (H - 1) S, as DDP;
//   ZeRO-3: the parameters gathered in the forward and again in the
//     backward, unit by unit: (n - L)(2 S - E), where E is the unit the
//     backward starts with, still gathered from the forward (the tied token
//     embedding and the positions: (vocab + seq_len) x hidden floats); the
//     gradients reduce-scattered: each unit's shards fit inline_bytes, so on
//     4 ranks the Gloo round folds them (Note [Folding round]): at step k a
//     rank sends S / 2^(k+1) to rank ^ 2^k, on another host from step log2 L
//     on, (H - 1) S in all (where the direct round sent (n - L) S; on 3 ranks,
//     no doubling, direct's (n - L) S is the same number, L being 1). On both
//     backends: this model's units are each below MESHTRAIN_HIER_MIN_KB
//     (64 KiB), so the hierarchical backend runs them flat.
// -1 where this note has no closed form.
double data_axis_formula(const Layout& l, double grad_bytes) {
  const std::string name = l.strategy.name;
  const int n = l.strategy.ranks, h = l.hosts, per_host = l.per_host;
  if (name == "ddp") return l.per_host > 1 ? 2.0 * (h - 1) * grad_bytes : 2.0 * (n - per_host) * grad_bytes;
  if (name == "zero1" || name == "zero2")
    return l.per_host > 1 ? 2.0 * (h - 1) * grad_bytes : 2.0 * (n - per_host) * grad_bytes;
  if (name == "zero3")  // E: kTiny's vocab, seq_len, hidden
    return (n - per_host) * (2 * grad_bytes - 4.0 * (64 + 16) * 32) + (h - 1) * grad_bytes;
  return -1;
}

void append_row(const Layout& l, const Value& got, double seconds) {
  const char* path = std::getenv("MESHTRAIN_STRATEGY_TABLE");
  if (path == nullptr) return;
  const Value& one = one_process();
  char row[512];
  std::snprintf(row, sizeof row, "| %s | %s | %d x %d | %s | %.1e | %.1e | %.0f | %.0f | %.0f | %.0f | %.1f |\n",
                l.strategy.name, l.strategy.flags, l.hosts, l.per_host, l.backend(),
                max_relative_difference(got, one, "losses"), max_relative_difference(got, one, "grad_norms"),
                inter_host_bytes(got, "dp"), inter_host_bytes(got, "pp"), inter_host_bytes(got, "tp"),
                inter_host_bytes(got, "all"), seconds);
  std::ofstream(path, std::ios::app) << row;
}

class AcrossHosts : public ::testing::TestWithParam<Layout> {};

TEST_P(AcrossHosts, TrainsLikeOneProcess) {
  const Layout& l = GetParam();
  ASSERT_EQ(l.strategy.ranks, l.hosts * l.per_host) << l.name();
  Hosts hosts(l.hosts);
  if (!hosts.ok()) GTEST_SKIP() << "cannot make network namespaces here: " << hosts.why();
  const Value& one = one_process();
  TempDir t;
  const auto start = std::chrono::steady_clock::now();
  Shell r = run_job(hosts, t, kCommon + l.strategy.flags + " --metrics-out " + t.file("m.json"), l.hosts, l.per_host);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_TRUE(contains(r.output, "node 0 exit 0")) << r.output;
  EXPECT_TRUE(contains(r.output, str_cat("communication backend ", l.backend(), " (world of ", l.strategy.ranks)))
      << r.output;
  const Value got = meshtrain::json::parse_file(t.file("m.json"));
  expect_same_losses(got, one, l.name());
  // The gradient norm before clipping, every step: the gradients themselves agree, not only the loss.
  EXPECT_LE(max_relative_difference(got, one, "grad_norms"), 1e-5) << l.name();
  // Something crossed hosts: the job really ran across them.
  EXPECT_GT(inter_host_bytes(got, "all"), 0) << l.name();
  // S: every parameter's fp32 gradient (ZeRO-2/3's state bytes are a shard's).
  const double formula = data_axis_formula(l, 4.0 * got["config"]["model"]["parameters"].num());
  if (formula >= 0) {
    EXPECT_EQ(inter_host_bytes(got, "dp"), formula) << l.name() << ": Note [Data-axis bytes across hosts]";
  }
  append_row(l, got, seconds);
}

// Names apart from the sample's: ctest gives a name one test (and one label).
#ifdef MESHTRAIN_FULL_CLUSTER
#define MESHTRAIN_ACROSS_HOSTS_SET ClusterProduct
#else
#define MESHTRAIN_ACROSS_HOSTS_SET Cluster
#endif
INSTANTIATE_TEST_SUITE_P(MESHTRAIN_ACROSS_HOSTS_SET, AcrossHosts, ::testing::ValuesIn(layouts()),
                         [](const ::testing::TestParamInfo<Layout>& info) { return info.param.name(); });

}  // namespace
