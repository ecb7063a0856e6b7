#pragma once
// meshtrain/models.h: GPT, GPT-2, Llama: plain modules, stages, activation checkpointing, generation.
// Part of the public API (meshtrain/meshtrain.h includes it); the sections below
// are in dependency order.

#include <c10/util/Optional.h>
#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/container/moduledict.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "meshtrain/nn.h"
#include "meshtrain/moe.h"
#include "meshtrain/util.h"

// ===== stage =====
// A model as a sequence of pieces (MLP: its layers; GPT: embedding, blocks,
// head). A Stage holds a contiguous run of pieces — the whole model, or one
// pipeline stage — as one Module whose parameters keep the full model's names
// ("blocks.3.attn.q.weight" whichever stage holds block 3), so checkpoints and
// comparisons line up across layouts.

namespace meshtrain {
namespace models {

class StageImpl : public torch::nn::Module {
 public:
  // Appends a piece. `group` nests it ("blocks" + key "3" -> "blocks.3"); an
  // empty group registers it at the top ("embed").
  template <typename ModuleHolder>
  void append(const std::string& group, const std::string& key, ModuleHolder piece) {
    if (group.empty()) {
      register_module(key, piece.ptr());
    } else {
      dict(group)->update({{key, piece.ptr()}});
    }
    pieces_.emplace_back(piece);
    checkpointed_.emplace_back();
  }
  // Applies the pieces in order.
  at::Tensor forward(at::Tensor x);
  // Applies pieces [first, last) only (pipeline virtual stages, tests).
  at::Tensor forward_range(at::Tensor x, size_t first, size_t last);
  size_t num_pieces() const { return pieces_.size(); }
  std::shared_ptr<torch::nn::Module> piece(size_t i) const { return pieces_.at(i).ptr(); }
  // Piece i recomputes its activations in backward (meshtrain/models.h).
  // The recompute's gradients go to the parameters the piece has now: set it
  // before zero::fully_shard, which replaces them in the piece's parameter
  // list by its shard (the layers keep computing with them).
  void set_checkpointed(size_t i, bool on);
  bool checkpointed(size_t i) const { return checkpointed_.at(i).has_value(); }

 private:
  torch::nn::ModuleDict dict(const std::string& group);
  std::vector<torch::nn::AnyModule> pieces_;
  std::vector<c10::optional<std::vector<at::Tensor>>> checkpointed_;  // the parameters, when checkpointed
};
TORCH_MODULE(Stage);

// ===== gpt =====
// The pieces of the built-in decoders, exposed for users who assemble their
// own models: a token embedding (with a learned position table for GPT and
// GPT-2), the GPT / GPT-2 block (pre-LayerNorm, causal multi-head attention
// with biases, an MLP with GELU) and the language-model head (a final norm and
// the projection to the vocabulary, tied to the token embedding or not).
// The Llama block is in llama.h. Every piece is plain torch::nn layers, cut for
// tensor parallelism from outside with models::tp_plan.

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

// ===== llama =====
// The Llama block, as Hugging Face's LlamaDecoderLayer: pre-RMSNorm, causal
// attention with rotary positions and grouped-query heads (kv_heads key/value
// heads, each serving heads / kv_heads query heads), and the SwiGLU MLP
// down(silu(gate(x)) * up(x)); no biases. With models::TokenEmbedding (tokens
// only) and models::LmHead (an RMSNorm and the projection, untied by default)
// it makes LlamaForCausalLM (models.h builds it: kind "llama").

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

// ===== models =====
// The built-in models, each a sequence of pieces (Stage, above) of plain torch::nn
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
  // The attention kernel (meshtrain/nn.h): how the scores are computed, not
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

// ===== checkpointing =====
// Activation checkpointing: run a block without keeping its activations and
// recompute them in backward (Chen et al. 2016; torch.utils.checkpoint).
//
//   x = models::checkpoint(block, x);   // any module holder with forward(Tensor)
//   x = models::checkpoint([&](const at::Tensor& h) { return f(h); }, x, params);
//
// Forward runs `fn` without recording a graph and keeps only its input. In
// backward the node recomputes fn(input) with grad enabled (the CPU random
// generator restored to its forward state, so dropout draws the same masks),
// differentiates it with torch::autograd::grad, and hands the gradients of the
// input and of `params` to the outer backward. Parameter gradients therefore
// arrive through their usual AccumulateGrad nodes in the outer pass, so DDP's,
// ZeRO's and FSDP's gradient hooks fire exactly as without checkpointing (a
// reentrant backward that accumulated into .grad itself would finish ZeRO's
// reduction inside the inner pass).
//
// Under tensor parallelism the recompute runs the block's tp collectives again,
// in the same order on every tp rank. Under ZeRO-3 the unit's parameters are
// re-gathered for its backward anyway (FSDP's RegatherBeforeBackward runs
// before this node), so the recompute uses them; nothing is kept gathered.
//
// Every tensor fn uses that needs a gradient must be the input or in `params`
// (a weight captured otherwise would get no gradient: checkpoint a tied LM
// head only with its weight in params). The input must not be modified in
// place between forward and backward (checked: an error names it).

using BlockFn = std::function<at::Tensor(const at::Tensor&)>;

at::Tensor checkpoint(BlockFn fn, const at::Tensor& input, std::vector<at::Tensor> params);

// Which pass of a checkpointed block this thread runs: its forward without a
// graph (kFirst), its recompute in backward (kRecompute), or neither. A layer
// that counts what training forwards route (models::MoE) counts the first
// pass, which runs in the step's order of forwards, and not the recompute,
// which runs the same tokens again inside a backward.
enum class CheckpointPass { kNone, kFirst, kRecompute };
CheckpointPass checkpoint_pass();

template <typename ModuleHolder>
at::Tensor checkpoint(ModuleHolder module, const at::Tensor& input) {
  return checkpoint([module](const at::Tensor& x) mutable { return module->forward(x); }, input, module->parameters());
}

// --activation-checkpointing: "none" -> 0, "blocks" -> 1, "every-N" -> N.
// Throws ConfigError naming the value.
int checkpointing_period(const std::string& policy);
// Whether piece `piece` of the model is recomputed: the GPT's blocks (never
// the embedding or the head) or the MLP's layers, block i when i % period == 0.
bool is_checkpointed_piece(const ModelConfig& config, const std::string& policy, int64_t piece);
// Marks the pieces of `stage` (whose first piece is the model's `first_piece`) under the policy.
void apply_checkpointing(StageImpl& stage, const ModelConfig& config, const std::string& policy, int64_t first_piece);

// ===== generate =====
// Text generation from a built-in language model (gpt, gpt2, llama) held
// whole in one process: the prompt runs through the model once, then one
// token at a time, each step computing attention for the new position only
// against a cache of the earlier keys and values (incremental decoding), or,
// with use_cache off, the whole sequence again (for comparison).
//
//   models::Stage model = models::build_stage(config, 0, models::num_pieces(config));
//   auto out = models::generate(config, *model, {1, 450, 4996}, models::GenerateOptions().max_new_tokens(40));

struct GenerateOptions {
  TORCH_ARG(int64_t, max_new_tokens) = 64;
  // 0: greedy (the most likely token, the first of equals); otherwise the
  // logits are divided by it before sampling.
  TORCH_ARG(double, temperature) = 1.0;
  TORCH_ARG(int64_t, top_k) = 0;    // sample among the k most likely tokens only (0: all)
  TORCH_ARG(double, top_p) = 1.0;   // nucleus: the fewest tokens whose probability reaches p (1: all)
  TORCH_ARG(uint64_t, seed) = 1234; // sampling draws from (seed, step): the same text for the same seed
  // Generation stops after producing one of these (the tokenizer's end of text).
  TORCH_ARG(std::vector<int64_t>, stop_ids) = {};
  TORCH_ARG(bool, use_cache) = true;
};

struct Generation {
  std::vector<int64_t> ids;   // the new tokens (a stop token included when one ended it)
  bool stopped = false;       // a stop token ended it
  bool hit_max_positions = false;  // the model's positions ran out first
  double prefill_seconds = 0;  // the prompt's forward
  double decode_seconds = 0;   // every later step
};

// Generates after `prompt` (token ids below config.vocab). The model is the
// whole model (build_stage over every piece, no tensor parallelism), put in
// eval mode for the call.
Generation generate(const ModelConfig& config, StageImpl& model, const std::vector<int64_t>& prompt,
                    const GenerateOptions& options = {});
// ConfigError naming the option when `options` cannot generate (a count
// below 1, a negative or non-finite temperature, top-k below 0, top-p outside
// (0, 1]); generate() checks it first, a command may check before loading.
void check_generate_options(const GenerateOptions& options);
// ConfigError naming the first parameter that holds NaN or infinity, how many
// of its values do, and `source`: such weights generate one token forever.
void check_finite_weights(const std::map<std::string, at::Tensor>& parameters, const std::string& source);

// The next token from the last position's logits [vocab] under the options
// (step numbers the draws).
int64_t sample_next(const at::Tensor& logits, const GenerateOptions& options, int64_t step);

}  // namespace models
}  // namespace meshtrain
