#pragma once
// The built-in models: an MLP classifier and a GPT-style decoder (token and
// position embeddings, pre-LayerNorm blocks with causal multi-head
// self-attention and an MLP, a final LayerNorm and an LM head tied to the token
// embedding by default). Both are built from pieces (stage.h) and from the
// tensor-parallel layers (tp/layers.h), plain when tp is absent or 1.

#include <torch/nn/modules/normalization.h>

#include <string>

#include "meshtrain/comm/communicator.h"
#include "meshtrain/models/stage.h"
#include "meshtrain/tp/layers.h"

namespace meshtrain {
namespace models {

struct ModelConfig {
  std::string kind = "gpt";  // "gpt" or "mlp"
  // GPT
  int64_t vocab = 128;
  int64_t seq_len = 32;
  int64_t hidden = 64;
  int64_t heads = 4;
  int64_t layers = 2;
  bool tie_embeddings = true;
  // MLP: `layers` linear layers in -> hidden -> ... -> classes
  int64_t features = 32;
  int64_t classes = 8;
  uint64_t seed = 1234;
};

// Where this rank's model parts sit in a mesh (tensor-parallel group; more later).
struct BuildContext {
  comm::CommPtr tp;              // null: no tensor parallelism
  bool sequence_parallel = false;
};

// Pieces: MLP: `layers` linear layers (pairs tensor-parallel: MlpColumn,
// MlpRow); GPT: embed, layers blocks, head.
// Checks the sizes and their divisibility by tp (ConfigError naming the value
// and the valid choices). build_stage calls it; the trainer calls it before
// any communication.
void validate(const ModelConfig& config, int tp_size = 1, bool sequence_parallel = false);
int64_t num_pieces(const ModelConfig& config);
// A stage holding pieces [first, last). The whole model: build_stage(c, 0, num_pieces(c), ctx).
Stage build_stage(const ModelConfig& config, int64_t first, int64_t last, const BuildContext& ctx = {});
// Mean loss of the model's output against targets (GPT: token cross-entropy;
// MLP: cross-entropy over classes).
at::Tensor loss(const ModelConfig& config, const at::Tensor& output, const at::Tensor& targets,
                const BuildContext& ctx = {});
// Parameter count of the whole (unsharded) model.
int64_t parameter_count(const ModelConfig& config);

// ---- GPT pieces (exposed for users who assemble their own models).

struct GptEmbeddingImpl : torch::nn::Module {
  GptEmbeddingImpl(const ModelConfig& c, const BuildContext& ctx);
  // [B, T] int64 -> [B, T, H] ([B, T/tp, H] under sequence parallelism)
  at::Tensor forward(const at::Tensor& tokens);
  tp::VocabParallelEmbedding tok{nullptr};
  at::Tensor pos;  // [seq_len, hidden], replicated
  BuildContext ctx;
};
TORCH_MODULE(GptEmbedding);

struct GptBlockImpl : torch::nn::Module {
  GptBlockImpl(const ModelConfig& c, int64_t index, const BuildContext& ctx);
  at::Tensor forward(const at::Tensor& x);  // [B, T, H] -> [B, T, H]
  at::Tensor attention(const at::Tensor& x);
  int64_t local_heads, head_dim;
  BuildContext ctx;
  torch::nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  tp::ColumnParallelLinear q{nullptr}, k{nullptr}, v{nullptr}, fc1{nullptr};
  tp::RowParallelLinear proj{nullptr}, fc2{nullptr};
};
TORCH_MODULE(GptBlock);

struct GptHeadImpl : torch::nn::Module {
  // Untied: the head owns its weight. Tied (the default) to `tied`, the
  // embedding's weight, when both live in this stage; when the embedding lives
  // on another pipeline rank the trainer registers a copy ("tied_weight") that
  // pp::Pipeline keeps in step (Note [Tied embeddings across pipeline stages]).
  GptHeadImpl(const ModelConfig& c, const BuildContext& ctx, at::Tensor tied);
  at::Tensor forward(const at::Tensor& x);  // [B, T, H] -> logits [B, T, vocab/tp]
  at::Tensor out_weight() const;
  void set_tied(at::Tensor w) { tied = std::move(w); }
  torch::nn::LayerNorm ln{nullptr};
  tp::ColumnParallelLinear out{nullptr};  // [vocab/tp, H] when untied
  at::Tensor tied;    // not registered: the embedding owns it
  comm::CommPtr tp;
  bool sequence_parallel = false;
};
TORCH_MODULE(GptHead);

struct MlpLayerImpl : torch::nn::Module {
  MlpLayerImpl(int64_t in, int64_t out, bool relu, uint64_t seed, const std::string& name);
  at::Tensor forward(const at::Tensor& x);
  at::Tensor weight, bias;
  bool relu;
};
TORCH_MODULE(MlpLayer);

// The MLP under tensor parallelism (Megatron's MLP): layers 2k and 2k+1 are a
// column-parallel linear (output features split, ReLU on the slice) and a
// row-parallel one (input features split, partial outputs all-reduced): one
// all-reduce per pair forward, one backward. An odd last layer stays
// replicated. Values equal the dense MlpLayer's, sliced.
struct MlpColumnImpl : tp::ColumnParallelLinearImpl {
  MlpColumnImpl(int64_t in, int64_t out, uint64_t seed, const std::string& name, comm::CommPtr tp);
  at::Tensor forward(const at::Tensor& x);  // [B, in] replicated -> [B, out/tp]
};
TORCH_MODULE(MlpColumn);

struct MlpRowImpl : tp::RowParallelLinearImpl {
  MlpRowImpl(int64_t in, int64_t out, bool relu, uint64_t seed, const std::string& name, comm::CommPtr tp);
  at::Tensor forward(const at::Tensor& x);  // [B, in/tp] -> [B, out] replicated
  bool relu;
};
TORCH_MODULE(MlpRow);

}  // namespace models
}  // namespace meshtrain
