// The planner's model-state prediction against what the trainer holds: for
// every layout of 3 and 4 ranks (dp x pp x tp, every ZeRO stage where dp > 1;
// in fp32 and in bf16-mixed; Llama and GPT-2 on the layouts of 4 ranks),
// each rank's parameter, gradient and optimizer bytes from the tensors it
// really holds (the metrics' state_bytes) are within 5% of
// plan::predict_rank_state_bytes for that rank's coordinates.
//
// With MESHTRAIN_PLAN_TABLE=FILE the comparison is also written there as a
// markdown table (bench/plan/run.sh puts it into docs/plan.md).

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>

#include "equivalence.h"
#include "harness.h"
#include "meshtrain/plan.h"
#include "app/trainer/memory_check.h"
#include "meshtrain/util.h"

namespace plan = meshtrain::plan;

namespace {

struct Row {
  std::string layout;
  int rank;
  plan::ModelStateBytes predicted, measured;
};

double ratio(int64_t measured, int64_t predicted) {
  return predicted == 0 ? (measured == 0 ? 1.0 : INFINITY) : static_cast<double>(measured) / predicted;
}

std::vector<plan::Layout> layouts_of(int world) {
  std::vector<plan::Layout> out;
  for (int dp = 1; dp <= world; ++dp)
    for (int pp = 1; dp * pp <= world; ++pp) {
      if (world % (dp * pp) != 0) continue;
      const int tp = world / (dp * pp);
      for (int zero = 0; zero <= (dp > 1 ? 3 : 0); ++zero) out.push_back({dp, pp, tp, zero});
    }
  return out;
}

std::string name_of(const plan::Layout& l, bool bf16) {
  std::ostringstream s;
  s << "dp " << l.dp << " x pp " << l.pp << " x tp " << l.tp;
  if (l.ep > 1) s << " (ep " << l.ep << ")";
  if (l.dp > 1) s << (l.zero ? ", ZeRO-" + std::to_string(l.zero) : ", DDP");
  if (bf16) s << ", bf16-mixed";
  return s.str();
}

// Runs the trainer on `layout` and returns each rank's measured state bytes.
std::vector<plan::ModelStateBytes> measure(const meshtrain::train::TrainConfig& base, const plan::Layout& layout,
                                           bool bf16) {
  auto c = base;
  if (bf16) c.precision = "bf16-mixed";
  c.dp = layout.dp;
  c.pp = layout.pp;
  c.tp = layout.tp;
  c.zero = layout.zero;
  c.ep = layout.ep;
  const int world = layout.dp * layout.pp * layout.tp;
  const auto m = meshtrain::testing::metrics_on_ranks(c, world);
  std::vector<plan::ModelStateBytes> out;
  if (m.type != meshtrain::json::Value::Type::kObject) return out;
  for (int r = 0; r < world; ++r) {
    const auto& s = m["ranks"][r]["state_bytes"];
    out.push_back({static_cast<int64_t>(s["parameters"].num()), static_cast<int64_t>(s["gradients"].num()),
                   static_cast<int64_t>(s["optimizer"].num())});
  }
  return out;
}

// One line per layout: rank 0's bytes, and the worst ratio over every rank and kind.
void write_table(const std::vector<Row>& rows, const std::string& path) {
  std::ofstream out(path);
  out << "| layout | ranks | rank 0 parameters (predicted / measured) | gradients | optimizer state | "
         "worst measured / predicted, any rank and kind |\n|---|---|---|---|---|---|\n";
  for (size_t i = 0; i < rows.size();) {
    size_t j = i;
    double worst = 1.0;
    for (; j < rows.size() && rows[j].layout == rows[i].layout; ++j) {
      for (double r : {ratio(rows[j].measured.parameters, rows[j].predicted.parameters),
                       ratio(rows[j].measured.gradients, rows[j].predicted.gradients),
                       ratio(rows[j].measured.optimizer, rows[j].predicted.optimizer)})
        if (std::abs(r - 1.0) > std::abs(worst - 1.0)) worst = r;
    }
    const Row& r0 = rows[i];
    char w[32];
    std::snprintf(w, sizeof w, "%.4f", worst);
    out << "| " << r0.layout << " | " << j - i << " | " << r0.predicted.parameters << " / " << r0.measured.parameters
        << " | " << r0.predicted.gradients << " / " << r0.measured.gradients << " | " << r0.predicted.optimizer << " / "
        << r0.measured.optimizer << " | " << w << " |\n";
    i = j;
  }
}

// Trains `c` on each run's layout (bf16-mixed or not) and compares every
// rank's measured state with predict_rank_state_bytes; the rows, for the
// table, and the worst relative difference.
std::vector<Row> compare_runs(const meshtrain::train::TrainConfig& c,
                              const std::vector<std::pair<plan::Layout, bool>>& runs, double& worst) {
  const plan::DecoderShape shape = meshtrain::train::decoder_shape(c.model);
  std::vector<Row> rows;
  for (const auto& [layout, bf16] : runs) {
    const auto measured = measure(c, layout, bf16);
    if (meshtrain::testing::in_rank_process() || ::testing::Test::HasFailure()) continue;
    const std::string name = c.model.kind + ", " + name_of(layout, bf16);
    const plan::Precision precision = bf16 ? plan::Precision::kBf16Mixed : plan::Precision::kFp32;
    for (int r = 0; r < layout.dp * layout.pp * layout.tp; ++r) {
      const int tp_rank = r % layout.tp, stage = r / layout.tp % layout.pp, dp_rank = r / (layout.tp * layout.pp);
      const auto predicted = plan::predict_rank_state_bytes(shape, layout, stage, tp_rank, dp_rank, precision);
      const auto& got = measured[r];
      rows.push_back({name_of(layout, bf16), r, predicted, got});
      for (auto [m, p, kind] : {std::make_tuple(got.parameters, predicted.parameters, "parameters"),
                                std::make_tuple(got.gradients, predicted.gradients, "gradients"),
                                std::make_tuple(got.optimizer, predicted.optimizer, "optimizer")}) {
        EXPECT_NEAR(ratio(m, p), 1.0, 0.05) << name << " rank " << r << " " << kind << ": measured " << m
                                            << " B, predicted " << p << " B";
        worst = std::max(worst, std::abs(ratio(m, p) - 1.0));
      }
    }
  }
  return rows;
}

}  // namespace

TEST(PlanVsTrainer, PredictedModelStateMatchesEveryRankWithinFivePercent) {
  auto c = meshtrain::testing::tiny_gpt();  // fp32 AdamW: the prediction's 4 + 4 + 8 bytes per parameter
  c.steps = 1;
  c.bucket_cap_mb = 0.01;  // several buckets: ZeRO's shards are cut bucket by bucket
  const plan::DecoderShape shape = meshtrain::train::decoder_shape(c.model);
  // fp32 (4 + 4 + 8 bytes per parameter) and bf16-mixed (2 + 2 + 12).
  std::vector<std::pair<plan::Layout, bool>> runs;
  for (int world : {3, 4})
    for (const plan::Layout& layout : layouts_of(world)) {
      if (!plan::layout_problem(shape, layout).empty()) continue;  // e.g. tp 3 does not divide 4 heads
      runs.push_back({layout, false});
      runs.push_back({layout, true});
    }
  double worst = 0;
  const std::vector<Row> rows = compare_runs(c, runs, worst);
  if (meshtrain::testing::in_rank_process()) return;
  std::cout << rows.size() << " ranks compared; worst |measured / predicted - 1| = " << worst << "\n";
  if (const char* path = std::getenv("MESHTRAIN_PLAN_TABLE")) write_table(rows, path);
}

// The other model kinds: Llama (grouped-query attention, SwiGLU, no biases;
// untied, and tied across pipeline stages) and GPT-2 (its vocabulary padded
// from 64 to 128 rows), fp32, on every layout of 4 ranks with DDP or ZeRO-3.
TEST(PlanVsTrainer, PredictedLlamaAndGpt2StateMatchEveryRankWithinFivePercent) {
  auto base = meshtrain::testing::tiny_gpt();
  base.steps = 1;
  base.bucket_cap_mb = 0.01;
  auto llama = base, tied_llama = base, gpt2 = base;
  llama.model.kind = tied_llama.model.kind = "llama";
  llama.model.kv_heads = tied_llama.model.kv_heads = 2;
  llama.model.tie_embeddings = false;  // llama's default (train::resolve)
  tied_llama.tie = "tied";
  gpt2.model.kind = "gpt2";
  double worst = 0;
  size_t compared = 0;
  for (const auto& c : {llama, tied_llama, gpt2}) {
    const plan::DecoderShape shape = meshtrain::train::decoder_shape(c.model);
    std::vector<std::pair<plan::Layout, bool>> runs;
    for (const plan::Layout& layout : layouts_of(4)) {
      if (layout.zero == 1 || layout.zero == 2 || !plan::layout_problem(shape, layout).empty()) continue;
      if (c.model.tie_embeddings && c.model.kind == "llama" && layout.pp == 1) continue;  // only the tied copy is new
      runs.push_back({layout, false});
    }
    compared += compare_runs(c, runs, worst).size();
  }
  if (meshtrain::testing::in_rank_process()) return;
  std::cout << compared << " ranks compared; worst |measured / predicted - 1| = " << worst << "\n";
}

// Mixtures of experts: the experts (Llama's SwiGLU experts, 4 per block) held
// apart under ep, ZeRO 1/2 over their replicas (2 under ZeRO-3), the rest
// sharded by ZeRO over dp.
TEST(PlanVsTrainer, PredictedExpertStateMatchesEveryRankWithinFivePercent) {
  auto c = meshtrain::testing::tiny_llama();
  c.steps = 1;
  c.bucket_cap_mb = 0.01;
  c.model.experts = 4;
  const std::vector<std::pair<plan::Layout, bool>> runs = {
      {plan::Layout{4, 1, 1, 0, 1, 2}, false},  // ep 2, two replicas of each expert, DDP
      {plan::Layout{4, 1, 1, 1, 1, 4}, false},  // ep 4, ZeRO-1 (the experts' replicas: each rank alone)
      {plan::Layout{4, 1, 1, 2, 1, 2}, false},  // ep 2, ZeRO-2: the experts' gradients sharded over 2 replicas
      {plan::Layout{2, 2, 1, 3, 1, 2}, false},  // pp 2, ZeRO-3 for the rest
      {plan::Layout{2, 1, 2, 0, 1, 2}, false},  // tp 2: the experts whole on both tp ranks
      {plan::Layout{4, 1, 1, 3, 1, 1}, false}}; // ep 1: the experts ZeRO-3-sharded with the rest
  double worst = 0;
  const size_t compared = compare_runs(c, runs, worst).size();
  if (meshtrain::testing::in_rank_process()) return;
  std::cout << compared << " ranks compared; worst |measured / predicted - 1| = " << worst << "\n";
}
