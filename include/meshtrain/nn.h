#pragma once
// meshtrain/nn.h: layers the models are made of, free of parallelism: norms, rotary, attention, sequences of pieces, experts.
// Part of the public API (meshtrain/meshtrain.h includes it); the sections below
// are in dependency order.

#include <ATen/ATen.h>
#include <ATen/core/Tensor.h>
#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

// ===== layers =====
// Layers language models share, as plain functions and modules that know
// nothing of parallelism: RMSNorm, rotary position embeddings (Hugging Face's
// rotate-half layout) and the key/value cache of incremental decoding. The
// attention kernels are in meshtrain/nn.h.

namespace meshtrain {
namespace nn {

// y = x / sqrt(mean(x^2) + eps) * weight over the last dimension, computed in
// float32 whatever x's dtype (as Hugging Face's LlamaRMSNorm and llama2.c).
struct RMSNormImpl : torch::nn::Module {
  RMSNormImpl(int64_t dim, double eps);
  at::Tensor forward(const at::Tensor& x);
  at::Tensor weight;  // [dim], ones
  double eps;
};
TORCH_MODULE(RMSNorm);

// Rotary position embedding (RoFormer; Hugging Face's LlamaRotaryEmbedding):
// channel pairs (i, i + d/2) of each head rotate by position * theta^(-2i/d).
// The tables are computed once in double precision for `max_positions`.
class Rotary {
 public:
  Rotary() = default;
  Rotary(int64_t head_dim, int64_t max_positions, double theta);
  // x [B, heads, T, d] at positions start .. start + T - 1.
  at::Tensor apply(const at::Tensor& x, int64_t start) const;
  // x [B, heads, T, d] at the given positions ([T] int64; context parallelism's chunks).
  at::Tensor apply(const at::Tensor& x, const at::Tensor& positions) const;

 private:
  at::Tensor cos_, sin_;  // [max_positions, d] float32
};

// The keys and values of every position seen so far, per block, so that a
// decoding step computes attention for its new positions only.
struct KVCache {
  at::Tensor k, v;  // [B, kv_heads, length, d]
  int64_t length() const { return k.defined() ? k.size(2) : 0; }
  // Appends the new positions' keys and values and returns all of them.
  std::pair<at::Tensor, at::Tensor> append(const at::Tensor& new_k, const at::Tensor& new_v);
};

// ===== attention =====
// Causal attention that never stores the T x T scores (FlashAttention, Dao et
// al. 2022; FlashAttention-2's loop order): keys and values are visited in
// blocks with an online softmax (a running row maximum m and sum l, the
// output rescaled by exp(m_old - m_new) as m grows), and only the output and
// each row's log-sum-exp lse = m + log l are kept for backward, which
// recomputes every block's probabilities as exp(q k^T / sqrt(d) - lse).
// Memory kept per layer is linear in T; the result equals the eager
// softmax(q k^T / sqrt(d)) v up to float reassociation.
//
// The pieces take the positions of their first query and key, so that a
// caller holding only part of a sequence (context parallelism: one rank's
// chunk of queries against another rank's chunk of keys) computes a partial
// result and merges it by log-sum-exp (merge_attention).
//
// meshtrain::nn is the layer of pure tensor math that the models and the
// strategies share (attention kernels, norms, rotary positions, the KV cache,
// and the modules through which a strategy changes a model from outside:
// meshtrain/nn.h, meshtrain/nn.h). It includes nothing of communication, so
// that cp (ring attention is built of these pieces) and the models both sit
// above it.

// Which kernel a model's attention runs. kAuto: flash from
// kFlashFromSeqLen positions on, eager below, so that short-sequence runs
// keep the numerics they (and the reference fixtures taken with them) had;
// flash measured no slower from 128 positions (docs/models.md).
enum class AttentionKernel { kAuto, kEager, kFlash };
constexpr int64_t kFlashFromSeqLen = 512;
// "auto" | "eager" | "flash"; a ConfigError naming the value otherwise.
AttentionKernel parse_attention_kernel(const std::string& value);
std::string attention_kernel_name(AttentionKernel kernel);
// The kernel kAuto resolves to for key length Tk.
AttentionKernel resolve_attention_kernel(AttentionKernel kernel, int64_t key_length);

struct FlashOptions {
  // Queries and keys per tile: a tile's scores are query_block x key_block
  // per head (x heads/kv_heads query heads per key head).
  int64_t query_block = 128;
  int64_t key_block = 128;
};

// softmax(q k^T / sqrt(d), causal) v, eager: the T x T scores computed and
// kept for backward. q [B, H, Tq, d]; k, v [B, KV, Tk, d] with KV dividing H:
// query head h reads key/value head h / (H / KV) (grouped-query attention,
// Hugging Face's repeat_kv). The queries are the last Tq of the Tk positions
// (Tq < Tk when decoding with a cache).
at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v);

// Autograd-aware causal attention, as the eager causal_attention: q [B, H, Tq,
// d], k and v [B, KV, Tk, d] with KV dividing H (query head h reads key head
// h / (H / KV), without repeating k and v); the queries are the last Tq of
// the Tk positions. Returns [B, H, Tq, d] in q's dtype; statistics in fp32
// (fp64 for fp64 inputs).
at::Tensor flash_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const FlashOptions& options = {});

// flash_attention or the eager causal_attention, as `kernel` resolves for
// the keys' length (what nn::CausalAttention runs by default).
at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, AttentionKernel kernel);

// --- The pieces, for callers that split a sequence (no autograd) ---------
// Queries and keys in the kernel's layout: q [B, KV, Tq, G, d] (G = H / KV
// query heads per key head, contiguous so that a block of queries is one
// matrix of Tq_block * G rows), k and v [B, KV, Tk, d].
struct AttentionPart {
  at::Tensor out;  // [B, KV, Tq, G, d], normalised over the keys seen
  at::Tensor lse;  // [B, KV, Tq, G], -inf for a query that saw no key
};
// [B, H, T, d] -> the kernel's [B, KV, T, G, d] (contiguous), and back.
at::Tensor to_kernel_layout(const at::Tensor& t, int64_t kv_heads);
at::Tensor from_kernel_layout(const at::Tensor& t);
// Query i sits at position q_start + i, key j at k_start + j; a query sees
// the keys at or before its position.
AttentionPart flash_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t q_start,
                            int64_t k_start, const FlashOptions& options = {});
// Gradients of a loss through out = attention over ALL the keys, restricted
// to the keys k, v given here: `out` and `lse` are the final (merged) ones,
// so dq of several key parts add up to the full dq. Shapes as flash_forward.
struct AttentionGrads {
  at::Tensor dq, dk, dv;
};
AttentionGrads flash_backward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
                              const at::Tensor& lse, const at::Tensor& dout, int64_t q_start, int64_t k_start,
                              const FlashOptions& options = {});
// The attention over the union of two disjoint key sets from each one's
// part: weights exp(lse_a - lse) and exp(lse_b - lse), lse = logaddexp.
AttentionPart merge_attention(const AttentionPart& a, const AttentionPart& b);

// ===== sequence =====
// What splitting a sequence over ranks changes in a model, as two
// parameterless modules a model registers as children, so that a strategy
// applied from outside finds and changes them (torchtitan's way: context
// parallelism swaps the attention function, the model's forward stays as it
// is):
//
//   CausalAttention  the attention of a decoder block, from the projections'
//                    outputs to the input of the output projection; it runs
//                    an attention function it holds (by default the local
//                    causal attention, eager or flash by the kernel choice)
//                    and, for Llama, rotates queries and keys by their
//                    positions (rotary)
//   Positions        where a module's tokens sit in their sequences (0 .. T-1
//                    by default): a learned position table's rows, rotary's
//                    angles
//
// cp::parallelize(model, cp) sets every CausalAttention's function to ring
// attention over cp and every Positions to the positions of the rank's two
// chunks of each sequence (meshtrain/cp.h); a user's own model that
// builds its attention and positions from these gets context parallelism
// the same way. Neither holds parameters: registering them changes no
// parameter's name.

// Causal attention: q [B, H, Tq, d], k and v [B, KV, Tk, d] (KV dividing H),
// the queries the last Tq of the Tk positions -> [B, H, Tq, d].
using AttentionFn = std::function<at::Tensor(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v)>;
// The global positions of a module's `length` tokens, [length] int64.
using PositionFn = std::function<at::Tensor(int64_t length)>;

class PositionsImpl : public torch::nn::Module {
 public:
  // The positions of `length` tokens that follow `start` earlier ones (a
  // decoding step after a cache of `start` positions): start .. start +
  // length - 1 by default; with a PositionFn set, its positions (start 0 only).
  at::Tensor forward(int64_t length, int64_t start = 0) const;
  // Null: back to the default.
  void set(PositionFn fn) { fn_ = std::move(fn); }
  // No PositionFn set: the tokens are whole sequences from `start` on.
  bool is_default() const { return !fn_; }

 private:
  PositionFn fn_;
};
TORCH_MODULE(Positions);

struct CausalAttentionOptions {
  explicit CausalAttentionOptions(int64_t head_dim) : head_dim_(head_dim) {}
  TORCH_ARG(int64_t, head_dim);
  // The default attention function's kernel (meshtrain/nn.h).
  TORCH_ARG(AttentionKernel, kernel) = AttentionKernel::kAuto;
  // Rotary positions (Llama): the tables' length; 0: none (GPT).
  TORCH_ARG(int64_t, rotary_positions) = 0;
  TORCH_ARG(double, rotary_theta) = 10000.0;
};

class CausalAttentionImpl : public torch::nn::Module {
 public:
  explicit CausalAttentionImpl(const CausalAttentionOptions& options);
  // The projections' outputs q [B, T, H d], k and v [B, T, KV d] (under
  // tensor parallelism this rank's heads: sizes are read from the tensors)
  // -> [B, T, H d], the output projection's input. With a cache, the new
  // positions' keys and values are appended and the queries attend to all.
  at::Tensor forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, KVCache* cache = nullptr);
  // The attention function; null: the local causal attention with the kernel.
  void set_attention(AttentionFn fn) { attention_ = std::move(fn); }
  bool has_default_attention() const { return !attention_; }

  CausalAttentionOptions options;
  Positions positions{nullptr};  // rotary's ("positions"); null without rotary

 private:
  AttentionFn attention_;
  Rotary rotary_;
};
TORCH_MODULE(CausalAttention);

// ===== experts =====
// What the strategies give a mixture of experts from outside (models::MoE
// implements both interfaces; a user's own MoE layer can too):
//
//   TokenStatistics  a layer whose statistics span whole sequences (the
//                    balance loss counts every token of them): context
//                    parallelism (cp::parallelize) tells it the ranks that
//                    hold the same sequences' other tokens
//   ExpertParallel   a layer whose experts can be spread over ranks, each
//                    holding a slice: expert parallelism (ep::parallelize)
//                    gives it an ExpertGroup, which moves routed rows to the
//                    ranks holding their experts and back
//
// The interfaces hold no communicator (nn sits below communication): the
// strategies implement them over theirs.

class TokenStatistics {
 public:
  // Sums a tensor in place over the group; every rank of the group calls it
  // at the same point of its step (a collective).
  using Sum = std::function<void(at::Tensor&)>;
  virtual ~TokenStatistics() = default;
  // The `members` ranks `sum` sums over hold the other tokens of this rank's
  // sequences.
  virtual void set_token_group(Sum sum, int members) = 0;
};

// Rows moved between the ranks of an ExpertGroup: the rows a rank received,
// in rank order, and how many came from each rank.
struct Exchanged {
  at::Tensor rows;
  std::vector<int64_t> counts;
};

// Ranks that each hold one of size() equal slices of a layer's experts.
class ExpertGroup {
 public:
  virtual ~ExpertGroup() = default;
  virtual int size() const = 0;
  virtual int rank() const = 0;
  // rows [sum(send_counts), ...]: the first send_counts[0] rows go to rank 0,
  // the next send_counts[1] to rank 1, ... Autograd-aware (the gradient of
  // the received rows goes back to their senders the same way); every rank
  // of the group calls it (a collective).
  virtual Exchanged exchange(const at::Tensor& rows, const std::vector<int64_t>& send_counts) = 0;
};

class ExpertParallel {
 public:
  virtual ~ExpertParallel() = default;
  // Keeps this rank's slice of the experts (slice group->rank() of
  // group->size()) and sends each route to the rank holding its expert.
  virtual void parallelize_experts(std::shared_ptr<ExpertGroup> group) = 0;
  virtual int64_t num_experts() const = 0;  // every rank's, whole
  // The group given, or null (every expert here).
  virtual const std::shared_ptr<ExpertGroup>& expert_group() const = 0;
};

}  // namespace nn
}  // namespace meshtrain
