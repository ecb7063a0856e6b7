// The decoder pieces GPT, GPT-2 and Llama share (token embedding, LM head) and
// the GPT / GPT-2 block.
#include "meshtrain/models.h"

#include <ATen/ATen.h>

#include <cmath>

#include "meshtrain/util.h"

namespace meshtrain {
namespace models {

torch::nn::Linear seeded_linear(int64_t in, int64_t out, bool bias, uint64_t seed, const std::string& name,
                                const InitSpec& weight_init, const InitSpec& bias_init) {
  torch::nn::Linear layer(torch::nn::LinearOptions(in, out).bias(bias));
  at::NoGradGuard no_grad;
  layer->weight.copy_(init_full(seed, name + ".weight", weight_init, {out, in}));
  if (bias) layer->bias.copy_(init_full(seed, name + ".bias", bias_init, {out}));
  return layer;
}

namespace {

// The token embedding's values (a head tied to it starts from them too). GPT-2's
// padded rows start at zero, as llm.c's checkpoints hold them: nothing reads
// them and nothing moves them (their logits are never predicted).
at::Tensor token_embedding_values(const ModelConfig& c) {
  at::Tensor w = init_full(c.seed, "embed.tok.weight", InitSpec::normal(0, 0.02), {padded_vocab(c), c.hidden});
  if (padded_vocab(c) > c.vocab) w.narrow(0, c.vocab, padded_vocab(c) - c.vocab).zero_();
  return w;
}

torch::nn::LayerNorm layer_norm(int64_t h, double eps) {
  return torch::nn::LayerNorm(torch::nn::LayerNormOptions({h}).eps(eps));  // weight 1, bias 0: deterministic
}

}  // namespace

TokenEmbeddingImpl::TokenEmbeddingImpl(const ModelConfig& c) {
  tok = register_module("tok", torch::nn::Embedding(torch::nn::EmbeddingOptions(padded_vocab(c), c.hidden)
                                                        ._weight(token_embedding_values(c))));
  if (c.kind == "llama") return;  // rotary positions, inside attention
  const double std = c.kind == "gpt2" ? 0.02 : 0.01;  // GPT-2's initializer range for every table
  pos = register_parameter("pos", init_full(c.seed, "embed.pos", InitSpec::normal(0, std), {max_positions(c), c.hidden}));
  positions = register_module("positions", nn::Positions());
}

at::Tensor TokenEmbeddingImpl::forward(const at::Tensor& tokens) {
  MESHTRAIN_CHECK(tokens.dim() == 2 && (!pos.defined() || tokens.size(1) <= pos.size(0)),
                  "the model's input must be [batch, seq", pos.defined() ? " <= " + std::to_string(pos.size(0)) : "",
                  "] token ids; got ", tokens.sizes());
  at::Tensor x = tok->forward(tokens);  // [B, T/tp, H] under sequence parallelism
  if (!pos.defined()) return x;
  // [1, T, H]: the rows of the tokens' positions (a look-up, not a slice, so
  // that under sequence parallelism the plan can hand this rank its part of
  // them, as the token embedding's output holds its part of the sequence).
  return x + at::embedding(pos, positions->forward(tokens.size(1)).unsqueeze(0));
}

at::Tensor TokenEmbeddingImpl::forward_at(const at::Tensor& tokens, int64_t start) {
  at::Tensor x = tok->forward(tokens);
  if (!pos.defined()) return x;
  MESHTRAIN_CHECK(start + tokens.size(1) <= pos.size(0), "position ", start + tokens.size(1) - 1,
                  " is beyond the model's ", pos.size(0), " positions");
  return x + pos.narrow(0, start, tokens.size(1));
}

GptBlockImpl::GptBlockImpl(const ModelConfig& c, int64_t index) : gelu_tanh(c.kind == "gpt2") {
  const std::string p = "blocks." + std::to_string(index) + ".";
  const InitSpec normal = InitSpec::normal(0, 0.02);
  // GPT-2: residual projections scaled by 1/sqrt(2 * layers).
  const InitSpec residual = InitSpec::normal(0, 0.02 / std::sqrt(2.0 * c.layers));
  const int64_t h = c.hidden, f = ffn_hidden(c);
  ln1 = register_module("ln1", layer_norm(h, c.norm_eps));
  q = register_module("q", seeded_linear(h, h, true, c.seed, p + "q", normal));
  k = register_module("k", seeded_linear(h, h, true, c.seed, p + "k", normal));
  v = register_module("v", seeded_linear(h, h, true, c.seed, p + "v", normal));
  proj = register_module("proj", seeded_linear(h, h, true, c.seed, p + "proj", residual));
  attn = register_module("attn", nn::CausalAttention(nn::CausalAttentionOptions(h / c.heads).kernel(c.attention)));
  ln2 = register_module("ln2", layer_norm(h, c.norm_eps));
  if (c.experts > 0) {
    moe = register_module("moe", MoE(block_moe_options(c, index)));
    return;
  }
  fc1 = register_module("fc1", seeded_linear(h, f, true, c.seed, p + "fc1", normal));
  fc2 = register_module("fc2", seeded_linear(f, h, true, c.seed, p + "fc2", residual));
}

at::Tensor GptBlockImpl::block(const at::Tensor& x, nn::KVCache* cache) {
  // q, k, v in that order (under tensor parallelism they share one
  // communication of their input); sizes are read from their outputs.
  const at::Tensor a = ln1->forward(x);
  const at::Tensor qa = q->forward(a), ka = k->forward(a), va = v->forward(a);
  at::Tensor h = x + proj->forward(attn->forward(qa, ka, va, cache));
  if (moe) return h + moe->forward(ln2->forward(h));
  const at::Tensor inner = fc1->forward(ln2->forward(h));
  return h + fc2->forward(gelu_tanh ? at::gelu(inner, "tanh") : at::gelu(inner));
}

at::Tensor GptBlockImpl::forward(const at::Tensor& x) { return block(x, nullptr); }

at::Tensor GptBlockImpl::forward_cached(const at::Tensor& x, nn::KVCache& cache) { return block(x, &cache); }

LmHeadImpl::LmHeadImpl(const ModelConfig& c, const BuildContext& ctx, at::Tensor tied_weight)
    : tied(std::move(tied_weight)) {
  if (c.kind == "llama") {
    norm = torch::nn::AnyModule(register_module("norm", nn::RMSNorm(c.hidden, c.norm_eps)));
  } else {
    norm = torch::nn::AnyModule(register_module("ln", layer_norm(c.hidden, c.norm_eps)));
  }
  const int64_t rows = padded_vocab(c);
  if (!c.tie_embeddings) {
    out = register_module("out", seeded_linear(c.hidden, rows, false, c.seed, "head.out", InitSpec::normal(0, 0.02)));
  } else if (ctx.tied_head_copy) {  // Note [Tied embeddings across pipeline stages]
    out = register_module("out", torch::nn::Linear(torch::nn::LinearOptions(c.hidden, rows).bias(false)));
    at::NoGradGuard no_grad;
    out->weight.copy_(token_embedding_values(c));
  }
}

at::Tensor LmHeadImpl::forward(const at::Tensor& x) {
  // Logits of this rank's vocabulary rows under tensor parallelism (the loss is vocab-parallel).
  at::Tensor h = norm.forward(x);
  if (out) return out->forward(h);
  MESHTRAIN_CHECK(tied.defined(), "LmHead: the head is tied to an embedding on another pipeline stage of this "
                  "rank and has not been given its weight (set_tied)");
  return at::matmul(h, tied.t());
}

}  // namespace models
}  // namespace meshtrain
