// Context parallelism on the trainer's mesh (--cp): each rank holds two
// chunks of every sequence, positions follow the chunks, attention is ring
// attention over the cp ranks, gradients are averaged and ZeRO's state is
// sharded over dp x cp. Every layout trains like one process (the equivalence
// contract), alone and with dp + ZeRO-3, tp with sequence parallelism, and a
// pipeline, on an odd cp. The ring itself is tests/dist/test_ring_attention.cpp.
#include <gtest/gtest.h>

#include "equivalence.h"

namespace meshtrain {
namespace testing {
namespace {

// Llama (rotary positions at the chunks') and GPT (learned positions, tied head) on cp alone.
TEST(ContextParallel, LlamaOnCp2AndCp4GptOnOddCp3) {
  train::TrainConfig l = tiny_llama();
  l.cp = 2;
  expect_trains_like_one_process(l, 2);
  l.cp = 4;  // 8 chunks of 2 positions
  expect_trains_like_one_process(l, 4);
  train::TrainConfig g = tiny_gpt();
  g.model.seq_len = 18;  // 2 x 3 chunks of 3
  g.cp = 3;
  expect_trains_like_one_process(g, 3);
}

TEST(ContextParallel, WithDataParallelZero3AndRecomputedBlocks) {
  train::TrainConfig c = tiny_llama();
  c.cp = 2;
  c.dp = 2;
  c.zero = 3;  // shards over the 4 ranks of dp x cp
  c.activation_checkpointing = "blocks";
  expect_trains_like_one_process(c, 4);
}

TEST(ContextParallel, WithTensorParallelismAndSequenceParallelism) {
  train::TrainConfig c = tiny_gpt();
  c.cp = 2;
  c.tp = 2;
  c.sequence_parallel = true;  // each rank's 8 positions split again over tp
  expect_trains_like_one_process(c, 4);
}

TEST(ContextParallel, WithPipelineAndTiedEmbeddings) {
  train::TrainConfig c = tiny_gpt();
  c.cp = 2;
  c.pp = 2;
  c.microbatches = 4;
  c.zero = 1;
  expect_trains_like_one_process(c, 4);
}

// The metrics name the ring's bytes: each rank sends, per block and step,
// its keys and values cp - 1 hops forward, and backward as many again plus
// cp hops of their (fp32) gradients.
TEST(ContextParallel, MetricsCountTheRingsBytes) {
  train::TrainConfig c = tiny_llama();
  c.cp = 2;
  const json::Value m = metrics_on_ranks(c, 2);
  if (m.type == json::Value::Type::kNull) return;  // in a rank process
  // k and v of 24 samples, 8 positions per rank, 2 key/value heads of 8 channels, fp32.
  const double kv = 2.0 * 24 * 8 * 2 * 8 * 4;
  const double per_block = (c.cp - 1) * kv + (c.cp - 1) * kv + c.cp * kv;
  ASSERT_EQ(m["ranks"].items.size(), 2u);
  for (const auto& rank : m["ranks"].items) {
    // The metrics' traffic is per step.
    EXPECT_EQ(rank["traffic_by_axis"]["cp"]["total"]["bytes_sent"].number, per_block * c.model.layers);
    EXPECT_GT(rank["traffic_by_axis"]["dp"]["total"]["bytes_sent"].number, 0);  // gradients over dp x cp
  }
  EXPECT_EQ(m["config"]["cp"].number, 2);
}

}  // namespace
}  // namespace testing
}  // namespace meshtrain
