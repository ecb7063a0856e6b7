// Gradient clipping and activation checkpointing where they meet the
// strategies' internals: ZeRO-3 regathering for the recompute, a tied
// embedding across pipeline stages, gradient accumulation under DDP, the
// article's master DP, and the full layout (dp 2 x pp 2 x tp 2 x ZeRO-3).

#include <gtest/gtest.h>

#include "equivalence.h"

using meshtrain::testing::expect_trains_like_one_process;
using meshtrain::testing::metrics_on_ranks;
using meshtrain::testing::tiny_gpt;

TEST(TrainingOptions, ZeroThreeRecomputesWithRegatheredUnitsAndClipsItsShards) {
  auto c = tiny_gpt();
  c.dp = 2;
  c.zero = 3;
  c.activation_checkpointing = "blocks";
  c.clip_grad_norm = 0.5;
  expect_trains_like_one_process(c, 2);
  c.dp = 3;  // shards that do not divide evenly
  c.global_batch = 24;
  expect_trains_like_one_process(c, 3);
}

TEST(TrainingOptions, TiedEmbeddingAcrossStagesIsCountedOnce) {
  auto c = tiny_gpt();
  c.pp = 2;
  c.microbatches = 4;
  c.clip_grad_norm = 0.5;
  c.activation_checkpointing = "every-2";
  c.optimizer = "sgd";  // the update is proportional to the clipping coefficient
  c.momentum = 0.9;
  expect_trains_like_one_process(c, 2);
}

TEST(TrainingOptions, AccumulationAndMasterDpClipTheWholeStepsGradient) {
  auto c = tiny_gpt();
  c.dp = 2;
  c.micro_batch = 4;  // 3 micro-batches per rank
  c.clip_grad_norm = 0.5;
  c.activation_checkpointing = "blocks";
  expect_trains_like_one_process(c, 2);
  auto m = tiny_gpt();
  m.strategy = "dp";
  m.clip_grad_norm = 0.5;
  m.optimizer = "sgd";
  expect_trains_like_one_process(m, 3);
}

// The command, fp32, at test size: 8 ranks.
TEST(TrainingOptions, EveryAxisWithZeroThreeCheckpointingAndClipping) {
  auto c = tiny_gpt();
  c.model.heads = 4;
  c.model.layers = 4;
  c.dp = 2;
  c.pp = 2;
  c.tp = 2;
  c.zero = 3;
  c.microbatches = 4;
  c.activation_checkpointing = "blocks";
  c.clip_grad_norm = 0.5;
  expect_trains_like_one_process(c, 8);
}

TEST(TrainingOptions, MetricsReportTheNormOfEveryStep) {
  auto c = tiny_gpt();
  c.dp = 2;
  c.clip_grad_norm = 0.5;
  const auto m = metrics_on_ranks(c, 2);
  if (::testing::Test::HasFailure() || m.type == meshtrain::json::Value::Type::kNull) return;
  ASSERT_EQ(m["grad_norms"].items.size(), static_cast<size_t>(c.steps));
  for (const auto& n : m["grad_norms"].items) EXPECT_GT(n.number, 0.5);  // clipped: the norm before clipping
  EXPECT_EQ(m["config"]["clip_grad_norm"].number, 0.5);
}
