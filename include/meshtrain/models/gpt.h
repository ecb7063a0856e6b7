#pragma once
// The pieces of the built-in decoders, exposed for users who assemble their
// own models: a token embedding (with a learned position table for GPT and
// GPT-2), the GPT / GPT-2 block (pre-LayerNorm, causal multi-head attention
// with biases, an MLP with GELU) and the language-model head (a final norm and
// the projection to the vocabulary, tied to the token embedding or not).
// The Llama block is in llama.h. Every piece is plain torch::nn layers, cut for
// tensor parallelism from outside with models::tp_plan.

#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include <string>

#include "meshtrain/nn/attention.h"
#include "meshtrain/nn/layers.h"
#include "meshtrain/nn/sequence.h"
#include "meshtrain/models/moe.h"
#include "meshtrain/util/init.h"

namespace meshtrain {
namespace models {

struct ModelConfig;
struct BuildContext;

// A block of a decoder that can run on new positions only, reading and
// extending a cache of the earlier positions' keys and values (generation).
class CachedBlock {
 public:
  virtual ~CachedBlock() = default;
  // x [B, Tnew, H] at positions cache.length() .. + Tnew - 1 -> [B, Tnew, H].
  virtual at::Tensor forward_cached(const at::Tensor& x, nn::KVCache& cache) = 0;
};

struct TokenEmbeddingImpl : torch::nn::Module {
  // GPT and GPT-2: token and learned position embeddings ("tok", "pos"),
  // the table read at the rows `positions` gives (context parallelism sets
  // them from outside); Llama: tokens only (positions are rotary, inside
  // attention).
  explicit TokenEmbeddingImpl(const ModelConfig& c);
  // [B, T] int64 -> [B, T, H]. The table is read with at::embedding, so
  // that sequence parallelism's plan ("embed.pos" kSequenceParallel) gives
  // the rows of the rank's part of the sequence.
  at::Tensor forward(const at::Tensor& tokens);
  // Tokens at positions start .. start + T - 1 (generation; the model whole).
  at::Tensor forward_at(const at::Tensor& tokens, int64_t start);
  torch::nn::Embedding tok{nullptr};
  at::Tensor pos;  // [max_positions, hidden], replicated; undefined for Llama
  nn::Positions positions{nullptr};  // where the tokens sit ("positions"); null for Llama
};
TORCH_MODULE(TokenEmbedding);
using GptEmbeddingImpl = TokenEmbeddingImpl;
using GptEmbedding = TokenEmbedding;

struct GptBlockImpl : torch::nn::Module, CachedBlock {
  GptBlockImpl(const ModelConfig& c, int64_t index);
  at::Tensor forward(const at::Tensor& x);  // [B, T, H] -> [B, T, H]
  at::Tensor forward_cached(const at::Tensor& x, nn::KVCache& cache) override;
  bool gelu_tanh;  // GPT-2's GELU (the tanh approximation, "gelu_new"); the built-in GPT's is exact
  // Causal multi-head attention between q, k, v and proj ("attn", no
  // parameters): the attention function context parallelism swaps.
  nn::CausalAttention attn{nullptr};
  torch::nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  torch::nn::Linear q{nullptr}, k{nullptr}, v{nullptr}, proj{nullptr}, fc1{nullptr}, fc2{nullptr};
  MoE moe{nullptr};  // ModelConfig::experts > 0: the MLP (fc1 and fc2 are then null)

 private:
  at::Tensor block(const at::Tensor& x, nn::KVCache* cache);
};
TORCH_MODULE(GptBlock);

struct LmHeadImpl : torch::nn::Module {
  // The final norm (GPT: LayerNorm "ln"; Llama: RMSNorm "norm") and the
  // projection to the vocabulary. Untied: the head owns its weight ("out").
  // Tied (GPT's default) to `tied`, the embedding's weight, when both live on
  // this rank; when the embedding lives on another pipeline rank
  // (ctx.tied_head_copy) "out" holds a copy (Note [Tied embeddings across
  // pipeline stages] in app/trainer/engine_mesh.cpp).
  LmHeadImpl(const ModelConfig& c, const BuildContext& ctx, at::Tensor tied);
  // [B, T, H] -> logits [B, T, padded_vocab] ([B, T, padded_vocab/tp], this
  // rank's vocabulary rows, once the head is cut by vocabulary)
  at::Tensor forward(const at::Tensor& x);
  void set_tied(at::Tensor w) { tied = std::move(w); }
  torch::nn::AnyModule norm;
  torch::nn::Linear out{nullptr};  // [vocab/tp, H] once cut
  at::Tensor tied;    // not registered: the embedding owns it
};
TORCH_MODULE(LmHead);
using GptHeadImpl = LmHeadImpl;
using GptHead = LmHead;

// A plain Linear whose values derive from seed + name (the layer's path), the
// same on every rank, so that tensor parallelism's slices agree.
torch::nn::Linear seeded_linear(int64_t in, int64_t out, bool bias, uint64_t seed, const std::string& name,
                                const InitSpec& weight_init, const InitSpec& bias_init = InitSpec::constant(0));

}  // namespace models
}  // namespace meshtrain
