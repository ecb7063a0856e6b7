#pragma once
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
// nn/sequence.h, nn/experts.h). It includes nothing of communication, so
// that cp (ring attention is built of these pieces) and the models both sit
// above it.

#include <ATen/ATen.h>

#include <cstdint>
#include <string>

namespace meshtrain {
namespace nn {

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

}  // namespace nn
}  // namespace meshtrain
