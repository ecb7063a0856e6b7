#pragma once
// The built-in models, each a sequence of pieces (stage.h) of plain torch::nn
// layers and nn's modules, knowing nothing of parallelism: every axis is
// applied from outside with the calls a user's model takes (the trainer's
// engine: tensor parallelism with tp_plan below, context and expert
// parallelism through nn's attention, positions and expert interfaces,
// ZeRO-3, activation checkpointing):
//   gpt    a small GPT (token and position embeddings, pre-LayerNorm blocks
//          with causal multi-head attention and a GELU MLP, a final LayerNorm,
//          an LM head tied to the token embedding by default)
//   gpt2   GPT-2 as llm.c's train_gpt2.c and Hugging Face's GPT2LMHeadModel:
//          the same shape with GELU's tanh approximation, and the vocabulary
//          padded to a multiple of 128 whose padded rows are never predicted
//   llama  Hugging Face's LlamaForCausalLM: RMSNorm, rotary positions,
//          grouped-query attention, SwiGLU, no biases, head untied by default
//   mlp    an MLP classifier
// Pieces: embedding, `layers` blocks, head (the MLP: its layers).

#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include <map>

#include <string>

#include "meshtrain/nn/attention.h"
#include "meshtrain/models/gpt.h"
#include "meshtrain/models/llama.h"
#include "meshtrain/models/stage.h"

namespace meshtrain {
namespace models {

struct ModelConfig {
  // "gpt" (the small built-in GPT), "gpt2" (GPT-2 as llm.c and Hugging Face's
  // GPT2LMHeadModel), "llama" (Hugging Face's LlamaForCausalLM) or "mlp".
  std::string kind = "gpt";
  // Language models
  int64_t vocab = 128;     // tokens the model predicts (gpt2: the embedding is padded_vocab rows)
  int64_t seq_len = 32;    // tokens per training sample
  // The longest sequence the model takes: rows of the position table (gpt,
  // gpt2), the rotary tables' length (llama); 0: seq_len. Checkpoints such as
  // GPT-2's have 1024 while training runs on shorter windows.
  int64_t max_positions = 0;
  int64_t hidden = 64;
  int64_t heads = 4;
  int64_t kv_heads = 0;    // llama: key/value heads (grouped-query attention); 0: heads
  int64_t ffn_hidden = 0;  // the MLP's inner size; 0: 4 x hidden (gpt, gpt2), Meta's 8/3 x hidden rounded up to 32 (llama)
  int64_t layers = 2;
  bool tie_embeddings = true;
  double rope_theta = 10000.0;  // llama: rotary base
  double norm_eps = 1e-5;       // LayerNorm (gpt, gpt2) and RMSNorm (llama) epsilon
  // The attention kernel (attention.h): how the scores are computed, not
  // what; every kernel gives the same result up to float reassociation.
  nn::AttentionKernel attention = nn::AttentionKernel::kAuto;
  // Mixture of experts (moe.h): experts > 0 makes every block's MLP a
  // models::MoE of `experts` MLPs of ffn_hidden each (GPT: GELU, Llama:
  // SwiGLU), each token computed by its top_k; capacity_factor 0: dropless;
  // aux_loss_coef: Switch Transformer's balance loss coefficient.
  int64_t experts = 0;
  int64_t top_k = 2;
  double capacity_factor = 0;
  double aux_loss_coef = 0.01;
  // MLP: `layers` linear layers in -> hidden -> ... -> classes
  int64_t features = 32;
  int64_t classes = 8;
  uint64_t seed = 1234;
};

// What a stage is built from besides the configuration (no communication:
// the axes are applied to the built stage from outside).
struct BuildContext {
  // The GPT head's stage lacks the embedding it is tied to, which another
  // rank holds: the head gets a copy ("head.out.weight") that pp::Pipeline
  // keeps in step (Note [Tied embeddings across pipeline stages]).
  bool tied_head_copy = false;
  // Values to start from (--init-from: a published checkpoint), by the whole
  // model's parameter names, full size; null: values from seed + name.
  const std::map<std::string, at::Tensor>* weights = nullptr;
};

// Pieces: MLP: `layers` linear layers (pairs tensor-parallel, Megatron's
// MLP); language models: embed, `layers` blocks, head.
// Checks the sizes and their divisibility by tp (ConfigError naming the value
// and the valid choices). build_stage and tp_plan call it; the trainer calls
// it before any communication.
void validate(const ModelConfig& config, int tp_size = 1, bool sequence_parallel = false);
int64_t num_pieces(const ModelConfig& config);
// A stage holding pieces [first, last), whole (every rank builds the same
// values; cut it with tp_plan). The whole model: build_stage(c, 0, num_pieces(c), ctx).
Stage build_stage(const ModelConfig& config, int64_t first, int64_t last, const BuildContext& ctx = {});
// Mean loss of the model's output against targets (language models: token
// cross-entropy over the first `vocab` logits; MLP: cross-entropy over
// classes), in one process. Under tensor parallelism the logits hold a
// vocabulary slice: train::model_loss.
at::Tensor loss(const ModelConfig& config, const at::Tensor& output, const at::Tensor& targets);
// The logits the model predicts from, `logits` holding rows [first_row,
// first_row + logits.size(-1)) of the (padded) vocabulary: GPT-2's padded
// rows left out (all of them held) or set to -inf (a slice: tensor
// parallelism's), so that no softmax gives them probability. Others: unchanged.
at::Tensor predicted_logits(const ModelConfig& config, const at::Tensor& logits, int64_t first_row = 0);
// The tensor-parallel plan of a stage's layers over tp_size ranks, as data
// (layer path -> style name; tensor parallelism's parallelize takes it):
// Megatron's cut, torchtitan's parallelize_llama. GPT: q, k, v, fc1 and an
// untied head "colwise", proj and fc2 "rowwise"; Llama: q, k, v, gate, up and
// an untied head "colwise", o and down "rowwise"; the token embedding
// "vocab_parallel"; under sequence parallelism the norms (LayerNorm, RMSNorm)
// and GPT's position table ("embed.pos") "sequence_parallel". MLP: layers 2k
// "colwise", 2k + 1 "rowwise" (an odd last layer stays whole). Validates the
// configuration for tp_size first (ConfigError naming the value).
std::map<std::string, std::string> tp_plan(const ModelConfig& config, torch::nn::Module& stage, int tp_size,
                                           bool sequence_parallel);
// Parameter count of the whole (unsharded) model (every expert's).
int64_t parameter_count(const ModelConfig& config);
// The parameters one token computes with: the count less the experts a token
// skips (experts - top_k of every MoE layer's); parameter_count without experts.
int64_t active_parameter_count(const ModelConfig& config);
// Model FLOPs of one training step per token (per sample for the MLP):
// forward and backward of every weight a token uses, 6 N (N active, without
// position tables),
// plus attention's 12 L H Q T (PaLM's appendix B; nanoGPT's estimate_mfu).
double training_flops_per_token(const ModelConfig& config);
// The MoE of block `index` when config.experts > 0 (its parameters
// "blocks.<index>.moe.*"): GPT's experts GELU (GPT-2's tanh GELU), Llama's
// SwiGLU.
MoEOptions block_moe_options(const ModelConfig& config, int64_t index);
// Whether the model reads token ids and predicts the next token (gpt, gpt2, llama).
bool is_language_model(const ModelConfig& config);
// Rows of the token embedding (and of a tied head): gpt2 pads the vocabulary to
// a multiple of 128 as llm.c does (50257 -> 50304); the padded rows are never
// predicted (the loss's softmax runs over the first `vocab`). Others: vocab.
int64_t padded_vocab(const ModelConfig& config);
// kv_heads, ffn_hidden and max_positions with their defaults applied.
int64_t kv_heads(const ModelConfig& config);
int64_t ffn_hidden(const ModelConfig& config);
int64_t max_positions(const ModelConfig& config);

// A layer of the MLP: a torch::nn::Linear (so tensor parallelism cuts it) with
// values from seed + name, and a ReLU after all but the last.
struct MlpLayerImpl : torch::nn::LinearImpl {
  MlpLayerImpl(int64_t in, int64_t out, bool relu, uint64_t seed, const std::string& name);
  at::Tensor forward(const at::Tensor& x);
  bool relu;
};
TORCH_MODULE(MlpLayer);

}  // namespace models
}  // namespace meshtrain
