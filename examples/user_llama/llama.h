#pragma once
// A user's own Llama (the shape of Hugging Face's LlamaForCausalLM: RMSNorm,
// rotary positions, grouped-query attention, SwiGLU, no biases, an untied
// head), written for one process from plain torch layers and meshtrain's nn
// pieces. Nothing here knows of parallelism: parallelize.h applies every
// axis from outside.
//
// What makes the axes reachable from outside: the attention is an
// nn::CausalAttention (its attention function and rotary positions are what
// context parallelism swaps), the layers are plain torch::nn::Linear and
// Embedding (what tensor parallelism cuts), and the pieces sit in a
// models::Stage (a sequence of modules whose pieces activation checkpointing
// can recompute). Parameter names are the Stage's: "tok.weight",
// "blocks.0.q.weight", ..., "head.norm.weight", "head.out.weight".

#include <torch/torch.h>

#include <string>

#include "meshtrain/models.h"
#include "meshtrain/nn.h"

namespace user_llama {

struct Config {
  int64_t vocab = 64, hidden = 32, heads = 4, kv_heads = 2, ffn = 64, layers = 3, seq_len = 16;
  double rope_theta = 10000.0;
  uint64_t seed = 7;
};

struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(const Config& c) {
    const int64_t d = c.hidden / c.heads;
    auto linear = [&](const char* name, int64_t in, int64_t out) {
      return register_module(name, torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(false)));
    };
    attn_norm = register_module("attn_norm", meshtrain::nn::RMSNorm(c.hidden, 1e-5));
    q = linear("q", c.hidden, c.heads * d);
    k = linear("k", c.hidden, c.kv_heads * d);
    v = linear("v", c.hidden, c.kv_heads * d);
    o = linear("o", c.heads * d, c.hidden);
    attn = register_module("attn", meshtrain::nn::CausalAttention(meshtrain::nn::CausalAttentionOptions(d)
                                                                      .rotary_positions(c.seq_len)
                                                                      .rotary_theta(c.rope_theta)));
    mlp_norm = register_module("mlp_norm", meshtrain::nn::RMSNorm(c.hidden, 1e-5));
    gate = linear("gate", c.hidden, c.ffn);
    up = linear("up", c.hidden, c.ffn);
    down = linear("down", c.ffn, c.hidden);
  }
  torch::Tensor forward(const torch::Tensor& x) {
    const torch::Tensor a = attn_norm(x);
    const torch::Tensor qa = q(a), ka = k(a), va = v(a);
    const torch::Tensor h = x + o(attn(qa, ka, va));
    const torch::Tensor n = mlp_norm(h);
    return h + down(torch::silu(gate(n)) * up(n));
  }
  meshtrain::nn::RMSNorm attn_norm{nullptr}, mlp_norm{nullptr};
  torch::nn::Linear q{nullptr}, k{nullptr}, v{nullptr}, o{nullptr}, gate{nullptr}, up{nullptr}, down{nullptr};
  meshtrain::nn::CausalAttention attn{nullptr};
};
TORCH_MODULE(Block);

struct HeadImpl : torch::nn::Module {
  explicit HeadImpl(const Config& c) {
    norm = register_module("norm", meshtrain::nn::RMSNorm(c.hidden, 1e-5));
    out = register_module("out", torch::nn::Linear(torch::nn::LinearOptions(c.hidden, c.vocab).bias(false)));
  }
  torch::Tensor forward(const torch::Tensor& x) { return out(norm(x)); }
  meshtrain::nn::RMSNorm norm{nullptr};
  torch::nn::Linear out{nullptr};
};
TORCH_MODULE(Head);

// The model: token ids [B, T] -> logits [B, T, vocab]. Every rank that builds
// it with the same config holds the same values (libtorch's default init
// after seeding), as the strategies need.
inline meshtrain::models::Stage build(const Config& c) {
  torch::manual_seed(c.seed);
  meshtrain::models::Stage model;
  model->append("", "tok", torch::nn::Embedding(c.vocab, c.hidden));
  for (int64_t i = 0; i < c.layers; ++i) model->append("blocks", std::to_string(i), Block(c));
  model->append("", "head", Head(c));
  return model;
}

}  // namespace user_llama
