#pragma once
// The built-in models: an MLP classifier and a GPT-style decoder (token and
// position embeddings, pre-LayerNorm blocks with causal multi-head
// self-attention and an MLP, a final LayerNorm and an LM head tied to the token
// embedding by default). Both are built from pieces (stage.h) of plain
// torch::nn layers, then cut for tensor parallelism by tp::parallelize with
// tp_plan below, as a user's model would be.

#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include <map>

#include <string>

#include "meshtrain/comm/communicator.h"
#include "meshtrain/models/stage.h"
#include "meshtrain/tp/layers.h"
#include "meshtrain/tp/parallelize.h"

namespace meshtrain {
namespace models {

struct ModelConfig {
  // "gpt" (the small built-in GPT), "gpt2" (GPT-2 as llm.c and Hugging Face's
  // GPT2LMHeadModel), "llama" (Hugging Face's LlamaForCausalLM) or "mlp".
  std::string kind = "gpt";
  // Language models
  int64_t vocab = 128;     // tokens the model predicts (gpt2: the embedding is padded_vocab rows)
  int64_t seq_len = 32;    // the longest sequence (gpt, gpt2: rows of the position table)
  int64_t hidden = 64;
  int64_t heads = 4;
  int64_t kv_heads = 0;    // llama: key/value heads (grouped-query attention); 0: heads
  int64_t ffn_hidden = 0;  // the MLP's inner size; 0: 4 x hidden (gpt, gpt2), Meta's 8/3 x hidden rounded up to 32 (llama)
  int64_t layers = 2;
  bool tie_embeddings = true;
  double rope_theta = 10000.0;  // llama: rotary base
  double norm_eps = 1e-5;       // LayerNorm (gpt, gpt2) and RMSNorm (llama) epsilon
  // MLP: `layers` linear layers in -> hidden -> ... -> classes
  int64_t features = 32;
  int64_t classes = 8;
  uint64_t seed = 1234;
};

// Where this rank's model parts sit in a mesh (tensor-parallel group; more later).
struct BuildContext {
  comm::CommPtr tp;              // null: no tensor parallelism
  bool sequence_parallel = false;
  // The GPT head's stage lacks the embedding it is tied to, which another
  // rank holds: the head gets a copy ("head.out.weight") that pp::Pipeline
  // keeps in step (Note [Tied embeddings across pipeline stages]).
  bool tied_head_copy = false;
};

// Pieces: MLP: `layers` linear layers (pairs tensor-parallel, Megatron's
// MLP); GPT: embed, layers blocks, head.
// Checks the sizes and their divisibility by tp (ConfigError naming the value
// and the valid choices). build_stage calls it; the trainer calls it before
// any communication.
void validate(const ModelConfig& config, int tp_size = 1, bool sequence_parallel = false);
int64_t num_pieces(const ModelConfig& config);
// A stage holding pieces [first, last), cut over ctx.tp by tp::parallelize
// with tp_plan. The whole model: build_stage(c, 0, num_pieces(c), ctx).
Stage build_stage(const ModelConfig& config, int64_t first, int64_t last, const BuildContext& ctx = {});
// Mean loss of the model's output against targets (GPT: token cross-entropy;
// MLP: cross-entropy over classes).
at::Tensor loss(const ModelConfig& config, const at::Tensor& output, const at::Tensor& targets,
                const BuildContext& ctx = {});
// The tensor-parallel plan of a stage's layers (Megatron's cut): GPT: q, k, v,
// fc1 and an untied head kColwise, proj and fc2 kRowwise, the token embedding
// kVocabParallel, under sequence parallelism the LayerNorms kSequenceParallel;
// MLP: layers 2k kColwise, 2k + 1 kRowwise (an odd last layer stays whole).
std::map<std::string, tp::Style> tp_plan(const ModelConfig& config, torch::nn::Module& stage, bool sequence_parallel);
// Parameter count of the whole (unsharded) model.
int64_t parameter_count(const ModelConfig& config);
// Whether the model reads token ids and predicts the next token (gpt, gpt2, llama).
bool is_language_model(const ModelConfig& config);
// Rows of the token embedding (and of a tied head): gpt2 pads the vocabulary to
// a multiple of 128 as llm.c does (50257 -> 50304); the padded rows are never
// predicted (the loss's softmax runs over the first `vocab`). Others: vocab.
int64_t padded_vocab(const ModelConfig& config);
// kv_heads and ffn_hidden with their defaults applied.
int64_t kv_heads(const ModelConfig& config);
int64_t ffn_hidden(const ModelConfig& config);

// ---- GPT pieces (exposed for users who assemble their own models).

struct GptEmbeddingImpl : torch::nn::Module {
  GptEmbeddingImpl(const ModelConfig& c, const BuildContext& ctx);
  // [B, T] int64 -> [B, T, H] ([B, T/tp, H] under sequence parallelism)
  at::Tensor forward(const at::Tensor& tokens);
  torch::nn::Embedding tok{nullptr};
  at::Tensor pos;  // [seq_len, hidden], replicated
  BuildContext ctx;  // under sequence parallelism: this rank's positions
};
TORCH_MODULE(GptEmbedding);

struct GptBlockImpl : torch::nn::Module {
  GptBlockImpl(const ModelConfig& c, int64_t index);
  at::Tensor forward(const at::Tensor& x);  // [B, T, H] -> [B, T, H]
  at::Tensor attention(const at::Tensor& x);
  int64_t head_dim;
  torch::nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  torch::nn::Linear q{nullptr}, k{nullptr}, v{nullptr}, proj{nullptr}, fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(GptBlock);

struct GptHeadImpl : torch::nn::Module {
  // Untied: the head owns its weight ("out"). Tied (the default) to `tied`, the
  // embedding's weight, when both live on this rank; when the embedding lives
  // on another pipeline rank (ctx.tied_head_copy) "out" holds a copy.
  GptHeadImpl(const ModelConfig& c, const BuildContext& ctx, at::Tensor tied);
  at::Tensor forward(const at::Tensor& x);  // [B, T, H] -> logits [B, T, vocab/tp]
  void set_tied(at::Tensor w) { tied = std::move(w); }
  torch::nn::LayerNorm ln{nullptr};
  torch::nn::Linear out{nullptr};  // [vocab/tp, H] once cut
  at::Tensor tied;    // not registered: the embedding owns it
};
TORCH_MODULE(GptHead);

// A layer of the MLP: a torch::nn::Linear (so tp::parallelize cuts it) with
// values from seed + name, and a ReLU after all but the last.
struct MlpLayerImpl : torch::nn::LinearImpl {
  MlpLayerImpl(int64_t in, int64_t out, bool relu, uint64_t seed, const std::string& name);
  at::Tensor forward(const at::Tensor& x);
  bool relu;
};
TORCH_MODULE(MlpLayer);

}  // namespace models
}  // namespace meshtrain
