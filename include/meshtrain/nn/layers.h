#pragma once
// Layers language models share, as plain functions and modules that know
// nothing of parallelism: RMSNorm, rotary position embeddings (Hugging Face's
// rotate-half layout) and the key/value cache of incremental decoding. The
// attention kernels are in nn/attention.h.

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <vector>

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

}  // namespace nn
}  // namespace meshtrain
