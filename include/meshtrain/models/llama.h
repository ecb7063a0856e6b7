#pragma once
// The Llama block, as Hugging Face's LlamaDecoderLayer: pre-RMSNorm, causal
// attention with rotary positions and grouped-query heads (kv_heads key/value
// heads, each serving heads / kv_heads query heads), and the SwiGLU MLP
// down(silu(gate(x)) * up(x)); no biases. With models::TokenEmbedding (tokens
// only) and models::LmHead (an RMSNorm and the projection, untied by default)
// it makes LlamaForCausalLM (models.h builds it: kind "llama").

#include <torch/nn/modules/linear.h>

#include "meshtrain/models/gpt.h"
#include "meshtrain/nn/attention.h"
#include "meshtrain/nn/layers.h"

namespace meshtrain {
namespace models {

struct LlamaBlockImpl : torch::nn::Module, CachedBlock {
  LlamaBlockImpl(const ModelConfig& c, int64_t index);
  at::Tensor forward(const at::Tensor& x);  // [B, T, H] -> [B, T, H]
  at::Tensor forward_cached(const at::Tensor& x, nn::KVCache& cache) override;
  // Rotary grouped-query attention between q, k, v and o ("attn", no
  // parameters): its attention function and positions are what context
  // parallelism swaps.
  nn::CausalAttention attn{nullptr};
  nn::RMSNorm attn_norm{nullptr}, mlp_norm{nullptr};
  torch::nn::Linear q{nullptr}, k{nullptr}, v{nullptr}, o{nullptr}, gate{nullptr}, up{nullptr}, down{nullptr};
  MoE moe{nullptr};  // ModelConfig::experts > 0: the MLP (gate, up and down are then null)

 private:
  at::Tensor block(const at::Tensor& x, nn::KVCache* cache);
};
TORCH_MODULE(LlamaBlock);

}  // namespace models
}  // namespace meshtrain
