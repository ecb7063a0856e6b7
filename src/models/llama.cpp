#include "meshtrain/models.h"

#include <ATen/ATen.h>


namespace meshtrain {
namespace models {

LlamaBlockImpl::LlamaBlockImpl(const ModelConfig& c, int64_t index) {
  const std::string p = "blocks." + std::to_string(index) + ".";
  const int64_t head_dim = c.hidden / c.heads;
  const InitSpec normal = InitSpec::normal(0, 0.02);  // Hugging Face's initializer_range
  const int64_t h = c.hidden, kv = kv_heads(c) * head_dim, f = ffn_hidden(c);
  attn_norm = register_module("attn_norm", nn::RMSNorm(h, c.norm_eps));
  q = register_module("q", seeded_linear(h, c.heads * head_dim, false, c.seed, p + "q", normal));
  k = register_module("k", seeded_linear(h, kv, false, c.seed, p + "k", normal));
  v = register_module("v", seeded_linear(h, kv, false, c.seed, p + "v", normal));
  o = register_module("o", seeded_linear(c.heads * head_dim, h, false, c.seed, p + "o", normal));
  attn = register_module("attn", nn::CausalAttention(nn::CausalAttentionOptions(head_dim).kernel(c.attention)
                                                         .rotary_positions(max_positions(c)).rotary_theta(c.rope_theta)));
  mlp_norm = register_module("mlp_norm", nn::RMSNorm(h, c.norm_eps));
  if (c.experts > 0) {
    moe = register_module("moe", MoE(block_moe_options(c, index)));
    return;
  }
  gate = register_module("gate", seeded_linear(h, f, false, c.seed, p + "gate", normal));
  up = register_module("up", seeded_linear(h, f, false, c.seed, p + "up", normal));
  down = register_module("down", seeded_linear(f, h, false, c.seed, p + "down", normal));
}

at::Tensor LlamaBlockImpl::block(const at::Tensor& x, nn::KVCache* cache) {
  // Under tensor parallelism q holds heads/tp heads, k and v kv_heads/tp
  // (query head j still reads key head j / (heads / kv_heads)), and under
  // sequence parallelism the whole sequence: attn reads sizes from them.
  const at::Tensor a = attn_norm->forward(x);
  const at::Tensor qa = q->forward(a), ka = k->forward(a), va = v->forward(a);
  const at::Tensor h = x + o->forward(attn->forward(qa, ka, va, cache));
  const at::Tensor n = mlp_norm->forward(h);
  if (moe) return h + moe->forward(n);
  return h + down->forward(at::silu(gate->forward(n)) * up->forward(n));
}

at::Tensor LlamaBlockImpl::forward(const at::Tensor& x) { return block(x, nullptr); }

at::Tensor LlamaBlockImpl::forward_cached(const at::Tensor& x, nn::KVCache& cache) { return block(x, &cache); }

}  // namespace models
}  // namespace meshtrain
