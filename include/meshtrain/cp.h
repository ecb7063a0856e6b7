#pragma once
// meshtrain/cp.h: context parallelism: ring attention over the cp ranks, applied from outside.
// Part of the public API (meshtrain/meshtrain.h includes it); the sections below
// are in dependency order.

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <cstdint>

#include "meshtrain/comm.h"
#include "meshtrain/nn.h"

// ===== parallelize =====
// cp::parallelize: context parallelism applied to a model from outside, its
// forward code left as it is (torchtitan's context_parallel, which swaps the
// attention function):
//
//   cp::parallelize(*model, mesh.cp());
//   auto x = cp::shard_sequence(tokens, 1, cp_size, cp_rank);   // this rank's two chunks
//   auto loss = loss_fn(model->forward(x), cp::shard_sequence(targets, 1, cp_size, cp_rank));
//
// Every nn::CausalAttention of the model (meshtrain/nn.h) then runs
// cp::ring_attention over `cp`, and every nn::Positions gives the positions
// of the rank's chunks (cp::local_positions), so a learned position table and
// rotary angles are read where the tokens sit; every layer with statistics
// over whole sequences (nn::TokenStatistics: a mixture of experts' balance
// loss) counts the cp group's tokens. The model's input is this rank's two
// chunks of every sequence (cp::shard_sequence along the sequence), the
// output its positions' predictions: each rank's loss is the mean over its
// tokens, and the gradients are averaged over the cp ranks as over data-
// parallel ones (the trainer's dp x cp group).
//
// A model whose attention is not an nn::CausalAttention would attend within
// each rank's chunks only and train wrong: refused. A cp of size 1 (or null)
// changes nothing. Apply once, before training.

namespace meshtrain {
namespace cp {

void parallelize(torch::nn::Module& model, const comm::CommPtr& cp);

// ===== ring attention =====
// Context parallelism: each rank of a cp group holds part of every sequence,
// and attention reaches the other parts by passing keys and values around
// the group's ring (ring attention, Liu et al. 2023; Megatron-Core's and
// torchtitan's context parallelism).
//
// Load balance (Megatron, torchtitan): the sequence is cut into 2 cp chunks
// of c = T / (2 cp) positions and rank r holds chunks r and 2 cp - 1 - r, so
// under the causal mask every rank has the same number of visible
// (query, key) pairs. A rank's local tensors are its two chunks, in that
// order.
//
// ring_attention: step i (0 <= i < cp) attends the rank's queries to the keys
// and values of rank r - i (flash tiles, nn::flash_forward, skipping
// chunk pairs the mask hides entirely) while the next rank's keys and values
// arrive, and merges the partial results by log-sum-exp. Backward passes the
// keys and values around once more, each with the gradient accumulated for
// them so far, which ends at the rank that owns them.

// The positions of rank cp_rank's two chunks: [first, first + chunk) and
// [second, second + chunk). ConfigError unless 2 cp divides seq_len.
struct ChunkLayout {
  int64_t chunk = 0, first = 0, second = 0;
};
ChunkLayout chunk_layout(int64_t seq_len, int cp_size, int cp_rank);
// The global positions of a rank's local tokens, [2 chunk] int64 (for
// position embeddings and rotary tables).
at::Tensor local_positions(int64_t seq_len, int cp_size, int cp_rank);
// x's part for cp_rank along `dim` (its two chunks, concatenated), and the
// inverse from every rank's part (parts[r] = rank r's).
at::Tensor shard_sequence(const at::Tensor& x, int64_t dim, int cp_size, int cp_rank);
at::Tensor unshard_sequence(const std::vector<at::Tensor>& parts, int64_t dim);

// Causal attention of this rank's queries over the whole sequence: q [B, H,
// 2c, d], k and v [B, KV, 2c, d], this rank's chunks (shard_sequence along
// dim 2). Autograd-aware; every rank of `cp` calls it (a collective). A null
// or size-1 `cp` is nn::flash_attention.
at::Tensor ring_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const comm::CommPtr& cp,
                          const nn::FlashOptions& options = {});

}  // namespace cp
}  // namespace meshtrain
