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
  // With the mesh's groups: cp (attention, the MoE's token group) and ep (the MoE's experts).
  LlamaBlockImpl(const ModelConfig& c, int64_t index, const BuildContext& ctx);
  at::Tensor forward(const at::Tensor& x);  // [B, T, H] -> [B, T, H]
  at::Tensor forward_cached(const at::Tensor& x, nn::KVCache& cache) override;
  int64_t head_dim;
  nn::AttentionKernel attention_kernel;
  comm::CommPtr cp;  // context parallelism: rotary at the chunks' positions, cp::ring_attention (BuildContext::cp)
  nn::RMSNorm attn_norm{nullptr}, mlp_norm{nullptr};
  torch::nn::Linear q{nullptr}, k{nullptr}, v{nullptr}, o{nullptr}, gate{nullptr}, up{nullptr}, down{nullptr};
  MoE moe{nullptr};  // ModelConfig::experts > 0: the MLP (gate, up and down are then null)

 private:
  at::Tensor attention(const at::Tensor& x, nn::KVCache* cache);
  at::Tensor block(const at::Tensor& x, nn::KVCache* cache);
  nn::Rotary rotary_;
};
TORCH_MODULE(LlamaBlock);

}  // namespace models
}  // namespace meshtrain
