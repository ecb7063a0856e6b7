// Flash attention on the mesh: the built-in models with --attention flash
// train like one process on layouts that touch attention (heads split over
// tp, the sequence gathered under sequence parallelism, pipeline stages,
// ZeRO-3's gathered weights, recomputed blocks). Flash against eager itself
// is tests/unit/test_attention.cpp.
#include <gtest/gtest.h>

#include "equivalence.h"

namespace meshtrain {
namespace testing {
namespace {

train::TrainConfig tiny_llama_with_flash() {
  train::TrainConfig c = tiny_llama();
  c.model.attention = nn::AttentionKernel::kFlash;
  return c;
}

TEST(FlashAttentionLayouts, DpTimesTpWithZero3AndPpTimesTpWithSequenceParallelism) {
  train::TrainConfig c = tiny_llama_with_flash();
  c.dp = 2;
  c.tp = 2;
  c.zero = 3;
  c.activation_checkpointing = "blocks";
  expect_trains_like_one_process(c, 4);
  train::TrainConfig p = tiny_llama_with_flash();
  p.model.kind = "gpt";
  p.model.kv_heads = 0;
  p.model.tie_embeddings = true;
  p.pp = 2;
  p.tp = 2;
  p.microbatches = 4;
  p.sequence_parallel = true;
  expect_trains_like_one_process(p, 4);
}

}  // namespace
}  // namespace testing
}  // namespace meshtrain
