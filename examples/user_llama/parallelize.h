#pragma once
// The user's parallelize_llama (torchtitan's, in C++): every axis applied to
// the plain model of llama.h from outside, in torchtitan's order, with the
// calls the built-in trainer makes on its own models:
//
//   tensor parallelism    tp::parallelize with a plan by layer path (q, k, v,
//   (+ sequence)          gate, up and the head column-parallel, o and down
//                         row-parallel, the token embedding by vocabulary;
//                         with sequence parallelism the norms too)
//   context parallelism   cp::parallelize: ring attention over cp, rotary at
//                         the positions of the rank's two chunks
//   activation            the blocks recompute in backward
//   checkpointing         (models::Stage::set_checkpointed)
//   FSDP                  zero::fully_shard on each block, then the rest,
//                         over dp x cp (the ranks holding other tokens, over
//                         which gradients are averaged)
//
// and the loss and the batches that go with them: every rank of a tp group
// reads its dp rank's samples and keeps its cp rank's two chunks of each
// sequence (cp::shard_sequence).

#include <torch/torch.h>

#include <map>
#include <string>
#include <utility>

#include "llama.h"
#include "meshtrain/comm.h"
#include "meshtrain/cp.h"
#include "meshtrain/tp.h"
#include "meshtrain/zero.h"

namespace user_llama {

struct Parallel {
  meshtrain::comm::CommPtr tp, cp, dp_cp;  // null: the axis is 1
  bool sequence_parallel = false;
  bool checkpoint = false;  // recompute the blocks in backward
};

inline std::map<std::string, meshtrain::tp::Style> tp_plan(const Config& c, bool sequence_parallel) {
  using meshtrain::tp::Style;
  std::map<std::string, Style> plan{{"tok", Style::kVocabParallel}, {"head.out", Style::kColwise}};
  if (sequence_parallel) plan["head.norm"] = Style::kSequenceParallel;
  for (int64_t i = 0; i < c.layers; ++i) {
    const std::string b = "blocks." + std::to_string(i) + ".";
    for (const char* name : {"q", "k", "v", "gate", "up"}) plan[b + name] = Style::kColwise;
    for (const char* name : {"o", "down"}) plan[b + name] = Style::kRowwise;
    if (sequence_parallel)
      for (const char* name : {"attn_norm", "mlp_norm"}) plan[b + name] = Style::kSequenceParallel;
  }
  return plan;
}

inline int size_of(const meshtrain::comm::CommPtr& c) { return c ? c->size() : 1; }

inline void parallelize(meshtrain::models::StageImpl& model, const Config& c, const Parallel& p) {
  if (size_of(p.tp) > 1) meshtrain::tp::parallelize(model, p.tp, tp_plan(c, p.sequence_parallel), {p.sequence_parallel});
  meshtrain::cp::parallelize(model, p.cp);
  // Before fully_shard, which takes the parameters the recompute differentiates.
  for (size_t i = 1; i + 1 < model.num_pieces(); ++i) model.set_checkpointed(i, p.checkpoint);
  if (!p.dp_cp) return;
  for (size_t i = 1; i + 1 < model.num_pieces(); ++i) meshtrain::zero::fully_shard(*model.piece(i), p.dp_cp);
  meshtrain::zero::fully_shard(model, p.dp_cp);  // the embedding and the head
}

// The mean cross-entropy over this rank's tokens; under tensor parallelism
// the head's logits hold this rank's slice of the vocabulary, never gathered.
inline torch::Tensor loss(const torch::Tensor& logits, const torch::Tensor& targets, const Parallel& p) {
  return meshtrain::tp::vocab_parallel_cross_entropy(logits.reshape({-1, logits.size(-1)}), targets.reshape({-1}), p.tp);
}

// Global batch `step`: `samples` sequences, each counting up by its own
// stride from its own start (a pattern the model learns), and their next tokens.
inline std::pair<torch::Tensor, torch::Tensor> batch(const Config& c, int64_t step, int64_t samples) {
  torch::manual_seed(1000 + step);
  const torch::Tensor start = torch::randint(c.vocab, {samples, 1}, torch::kLong);
  const torch::Tensor stride = torch::randint(1, 4, {samples, 1}, torch::kLong);
  const torch::Tensor tokens = (start + stride * torch::arange(c.seq_len + 1, torch::kLong)) % c.vocab;
  return {tokens.narrow(1, 0, c.seq_len), tokens.narrow(1, 1, c.seq_len)};
}

// This rank's part of a global batch: dp rank `dp_rank`'s samples of `dp`, cp
// rank `cp_rank`'s two chunks of each of its sequences.
inline torch::Tensor my_part(const torch::Tensor& global, int dp, int dp_rank, int cp, int cp_rank) {
  const torch::Tensor mine = global.chunk(dp, 0)[dp_rank];
  return cp > 1 ? meshtrain::cp::shard_sequence(mine, 1, cp, cp_rank) : mine;
}

}  // namespace user_llama
