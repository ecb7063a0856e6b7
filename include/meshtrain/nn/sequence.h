#pragma once
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
// chunks of each sequence (cp/ring_attention.h); a user's own model that
// builds its attention and positions from these gets context parallelism
// the same way. Neither holds parameters: registering them changes no
// parameter's name.

#include <ATen/core/Tensor.h>
#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <functional>

#include "meshtrain/nn/attention.h"
#include "meshtrain/nn/layers.h"

namespace meshtrain {
namespace nn {

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
  // The default attention function's kernel (nn/attention.h).
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

}  // namespace nn
}  // namespace meshtrain
