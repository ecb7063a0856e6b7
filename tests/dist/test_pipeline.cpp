// Pipelines train exactly like one process: every schedule, pp = 2, 3, 4,
// micro-batches from 1 to 8, a layer count no stage count divides, and dp x pp
// with DDP and every ZeRO stage.

#include <gtest/gtest.h>

#include "equivalence.h"

using meshtrain::testing::expect_trains_like_one_process;
using meshtrain::testing::tiny_gpt;

namespace {

struct Case {
  std::string schedule;
  int pp;
  int microbatches;
  int virtual_stages;
  std::string optimizer = "adamw";
  int layers = 5;  // 7 pieces (embedding, 5 blocks, head): no stage count divides them
};

class PipelineEquivalence : public ::testing::TestWithParam<Case> {};

TEST_P(PipelineEquivalence, GptMatchesOneProcess) {
  const Case& p = GetParam();
  auto c = tiny_gpt();
  c.model.layers = p.layers;
  // 24 samples split into 1-4, 6 or 8 micro-batches; 5 and 7 get 4 samples each.
  if (c.global_batch % p.microbatches != 0) c.global_batch = 4 * p.microbatches;
  c.pp = p.pp;
  c.schedule = p.schedule;
  c.microbatches = p.microbatches;
  c.virtual_stages = p.virtual_stages;
  c.optimizer = p.optimizer;
  if (p.optimizer == "sgd") c.momentum = 0.9;
  expect_trains_like_one_process(c, p.pp);
}

std::vector<Case> cases() {
  std::vector<Case> out;
  for (int pp : {2, 3, 4}) {
    out.push_back({"naive", pp, 1, 1});
    for (const char* s : {"gpipe", "1f1b"}) {
      for (int m = 1; m <= 8; ++m) out.push_back({s, pp, m, 1});
      out.push_back({s, pp, 8, 1, "sgd"});
    }
  }
  out.push_back({"interleaved", 2, 2, 2});
  out.push_back({"interleaved", 2, 8, 3});
  out.push_back({"interleaved", 2, 8, 3, "sgd"});
  out.push_back({"interleaved", 3, 6, 2});
  out.push_back({"interleaved", 4, 4, 2, "adamw", 6});  // 8 pieces on 4 ranks x 2 chunks
  out.push_back({"interleaved", 4, 8, 2, "sgd", 6});
  return out;
}

INSTANTIATE_TEST_SUITE_P(Schedules, PipelineEquivalence, ::testing::ValuesIn(cases()), [](const auto& info) {
  const Case& c = info.param;
  return c.schedule + "_pp" + std::to_string(c.pp) + "_m" + std::to_string(c.microbatches) +
         (c.virtual_stages > 1 ? "_v" + std::to_string(c.virtual_stages) : "") + "_" + c.optimizer;
});

TEST(Pipeline, DataParallelTimesPipelineWithEveryZeroStage) {
  for (int zero : {0, 1, 2, 3}) {
    auto c = tiny_gpt();
    c.model.layers = 4;
    c.dp = 2;
    c.pp = 2;
    c.zero = zero;
    c.microbatches = 3;
    c.bucket_cap_mb = 0.01;
    expect_trains_like_one_process(c, 4);
  }
}

// Cuts the user chose instead of the balanced ones: the embedding alone on
// stage 0, four blocks on stage 1, the last block and the head on stage 2.
TEST(Pipeline, ExplicitStageBoundaries) {
  auto c = tiny_gpt();
  c.model.layers = 5;  // 7 pieces
  c.pp = 3;
  c.microbatches = 4;
  c.stage_boundaries = {1, 5};
  expect_trains_like_one_process(c, 3);
}

TEST(Pipeline, UntiedHeadAndAnMlp) {
  auto c = tiny_gpt();
  c.model.tie_embeddings = false;
  c.pp = 3;
  c.microbatches = 4;
  expect_trains_like_one_process(c, 3);
  auto mlp = meshtrain::testing::tiny_mlp();
  mlp.pp = 2;
  mlp.schedule = "gpipe";
  mlp.microbatches = 4;
  expect_trains_like_one_process(mlp, 2);
}

}  // namespace
