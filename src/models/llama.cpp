#include "meshtrain/models/llama.h"

#include <ATen/ATen.h>

#include "meshtrain/cp/ring_attention.h"
#include "meshtrain/models/models.h"

namespace meshtrain {
namespace models {

LlamaBlockImpl::LlamaBlockImpl(const ModelConfig& c, int64_t index) : LlamaBlockImpl(c, index, BuildContext{}) {}

LlamaBlockImpl::LlamaBlockImpl(const ModelConfig& c, int64_t index, const BuildContext& ctx)
    : head_dim(c.hidden / c.heads), attention_kernel(c.attention), cp(ctx.cp), rotary_(c.hidden / c.heads, max_positions(c), c.rope_theta) {
  const std::string p = "blocks." + std::to_string(index) + ".";
  const InitSpec normal = InitSpec::normal(0, 0.02);  // Hugging Face's initializer_range
  const int64_t h = c.hidden, kv = kv_heads(c) * head_dim, f = ffn_hidden(c);
  attn_norm = register_module("attn_norm", nn::RMSNorm(h, c.norm_eps));
  q = register_module("q", seeded_linear(h, c.heads * head_dim, false, c.seed, p + "q", normal));
  k = register_module("k", seeded_linear(h, kv, false, c.seed, p + "k", normal));
  v = register_module("v", seeded_linear(h, kv, false, c.seed, p + "v", normal));
  o = register_module("o", seeded_linear(c.heads * head_dim, h, false, c.seed, p + "o", normal));
  mlp_norm = register_module("mlp_norm", nn::RMSNorm(h, c.norm_eps));
  if (c.experts > 0) {
    moe = register_module("moe", MoE(block_moe_options(c, index, ctx)));
    return;
  }
  gate = register_module("gate", seeded_linear(h, f, false, c.seed, p + "gate", normal));
  up = register_module("up", seeded_linear(h, f, false, c.seed, p + "up", normal));
  down = register_module("down", seeded_linear(f, h, false, c.seed, p + "down", normal));
}

at::Tensor LlamaBlockImpl::attention(const at::Tensor& x, nn::KVCache* cache) {
  // Sizes from the outputs: under tensor parallelism they hold this rank's
  // heads (q: heads/tp, k and v: kv_heads/tp, so query head j still reads key
  // head j / (heads / kv_heads)), under sequence parallelism the whole sequence.
  const at::Tensor q_out = q->forward(x), k_out = k->forward(x), v_out = v->forward(x);
  const int64_t B = q_out.size(0), T = q_out.size(1);
  auto heads = [&](const at::Tensor& t) { return t.view({B, T, t.size(2) / head_dim, head_dim}).transpose(1, 2); };
  at::Tensor qh, kh, vh = heads(v_out);
  if (cp::cp_size(cp) > 1) {  // this rank's chunks of the sequence: rotary at their positions
    const at::Tensor positions = cp::my_positions(T, cp);
    qh = rotary_.apply(heads(q_out), positions);
    kh = rotary_.apply(heads(k_out), positions);
  } else {
    const int64_t start = cache ? cache->length() : 0;
    qh = rotary_.apply(heads(q_out), start);
    kh = rotary_.apply(heads(k_out), start);
  }
  if (cache) std::tie(kh, vh) = cache->append(kh, vh);
  const at::Tensor y = cp::attention(qh, kh, vh, attention_kernel, cp);  // [B, heads, T, head_dim]
  return o->forward(y.transpose(1, 2).reshape({B, T, q_out.size(2)}));
}

at::Tensor LlamaBlockImpl::block(const at::Tensor& x, nn::KVCache* cache) {
  const at::Tensor h = x + attention(attn_norm->forward(x), cache);
  const at::Tensor n = mlp_norm->forward(h);
  if (moe) return h + moe->forward(n);
  return h + down->forward(at::silu(gate->forward(n)) * up->forward(n));
}

at::Tensor LlamaBlockImpl::forward(const at::Tensor& x) { return block(x, nullptr); }

at::Tensor LlamaBlockImpl::forward_cached(const at::Tensor& x, nn::KVCache& cache) { return block(x, &cache); }

}  // namespace models
}  // namespace meshtrain
