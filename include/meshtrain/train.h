#pragma once
// meshtrain/train.h: datasets and llm.c token shards, metrics, checkpoints, clipping, and the Trainer.
// Part of the public API (meshtrain/meshtrain.h includes it); the sections below
// are in dependency order.

#include <ATen/core/Tensor.h>
#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <cstdio>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "meshtrain/comm.h"
#include "meshtrain/util.h"
#include "meshtrain/mesh.h"
#include "meshtrain/dp.h"
#include "meshtrain/moe.h"
#include "meshtrain/pp.h"
#include "meshtrain/tp.h"
#include "meshtrain/zero.h"

// ===== data =====
// Datasets as deterministic functions of a global sample index: sample i has
// the same value on every rank, whatever the layout, so the global batch of
// step k is samples [k*G, (k+1)*G) everywhere and each data-parallel rank takes
// its contiguous slice ("data order is global, then split").

namespace meshtrain {
namespace train {

struct Batch {
  at::Tensor inputs;
  at::Tensor targets;
};

class Dataset {
 public:
  virtual ~Dataset() = default;
  // Samples [first, first + count).
  virtual Batch samples(int64_t first, int64_t count) const = 0;
  // Tokens per sample (sequence length for language models, 1 otherwise).
  virtual int64_t tokens_per_sample() const = 0;
  virtual std::string describe() const = 0;
};

// Lines of arithmetic ("17+25=42\n" with digits = 2) as byte tokens; sample i
// is a window of seq_len + 1 bytes starting at a line. Learnable: the answers
// follow the prompt. Operands have up to `digits` digits.
std::unique_ptr<Dataset> make_arithmetic_dataset(uint64_t seed, int64_t seq_len, int digits = 1);
// Windows of seq_len + 1 bytes of a text file at positions drawn from (seed, i).
std::unique_ptr<Dataset> make_text_dataset(const std::string& path, uint64_t seed, int64_t seq_len);
// Gaussian features; the label is the argmax of a fixed random linear teacher.
std::unique_ptr<Dataset> make_classification_dataset(uint64_t seed, int64_t features, int64_t classes);

// An arithmetic problem for evaluation: the prompt "a+b=" and the answer "c".
struct ArithmeticProblem {
  std::string prompt;
  std::string answer;
};
std::vector<ArithmeticProblem> arithmetic_eval_problems(uint64_t seed, int count, int digits = 1);
// The byte text of arithmetic sample i (for tests and examples).
std::string arithmetic_text(uint64_t seed, int64_t sample, int64_t length, int digits = 1);

// ===== token shards =====
// Token shards: llm.c's (and nanoGPT-style) pre-tokenized training data, read
// memory-mapped.
//
// File format (llm.c, dev/data/data_common.py write_datafile, version 1):
//   header  256 little-endian int32: [0] magic 20240520, [1] version 1,
//           [2] number of tokens N, [3] the vocabulary size (written by
//           `meshtrain data`; 0 in llm.c's own shards), [4..255] zero
//   body    N little-endian uint16 token ids
// so a shard is exactly 1024 + 2 N bytes.
//
// Samples: the shards, in path order, are cut into windows of seq_len + 1
// tokens with stride seq_len (llm.c's loader; a window never crosses a
// shard). Sample i of the run is window data::sample_at(i, W, seed, shuffle)
// of the W windows (meshtrain/data.h): by default a new seeded permutation of
// all windows every epoch, the same on every layout and rank; in order
// (window i mod W, llm.c's unshuffled loader) with --no-shuffle. The global
// batch of step k is samples [kG, (k+1)G) on every layout, so the position in
// the data is the step number (a checkpoint's step), and resuming, on any
// layout, continues at the same sample.

constexpr int32_t kTokenShardMagic = 20240520;
constexpr int32_t kTokenShardVersion = 1;
constexpr int64_t kTokenShardHeaderInts = 256;

// The files `pattern` names: itself, or a glob's matches, sorted. ConfigError
// (starting with `flag`) when a glob matches nothing.
std::vector<std::string> expand_data_paths(const std::string& pattern, const std::string& flag = "--data");

// Whether `path` starts with the token-shard magic number.
bool is_token_shard(const std::string& path);

// Whether --data means token shards: a glob, a .bin file, or a file with the
// shard magic (anything else is a text file).
bool data_is_token_shards(const std::string& data);

// Checks every shard (header, size, every token id below `vocab`, enough
// tokens for one window); ConfigError naming the file, what is wrong and the
// fix, prefixed by `flag` (--data, --val-data). Runs before any communication.
// Returns the number of windows of seq_len + 1 tokens.
int64_t check_token_shards(const std::vector<std::string>& paths, int64_t vocab, int64_t seq_len,
                           const std::string& flag = "--data");

// The vocabulary the shards' headers record (int [3], `meshtrain data`
// writes it), 0 when none records one (llm.c's shards). Shards that record
// different vocabularies were written by different tokenizers: ConfigError
// naming two of them and `flag`.
int64_t token_shards_vocab(const std::vector<std::string>& paths, const std::string& flag = "--data");

// The order samples read the windows in.
struct WindowOrder {
  // A seeded permutation of all windows per epoch; off: file order.
  TORCH_ARG(bool, shuffle) = true;
  TORCH_ARG(uint64_t, seed) = 0;
  // Every token read is checked below it (0: not checked): a shard rewritten
  // under a running job is an error naming it, never an id a vocabulary-parallel
  // layer would silently mask.
  TORCH_ARG(int64_t, vocab) = 0;
};

// The dataset over checked shards.
std::unique_ptr<Dataset> make_token_shard_dataset(const std::vector<std::string>& paths, int64_t seq_len,
                                                  WindowOrder order = WindowOrder());

// Writes `text_paths` (concatenated, byte-level tokens: each byte is a token,
// vocabulary 256) as shards `<prefix>_000000.bin`, ... of at most
// `tokens_per_shard` tokens; returns their paths. data::write_token_shards
// (meshtrain/data.h) takes any tokenizer and a held-out split.
std::vector<std::string> write_token_shards(const std::vector<std::string>& text_paths, const std::string& prefix,
                                            int64_t tokens_per_shard);

// ===== metrics =====
// What the trainer measures and reports: memory held per rank, peak RSS,
// traffic per step, and the loss curve (terminal plot, SVG).

// Bytes of training state this rank holds, from the tensors themselves.
struct StateBytes {
  int64_t parameters = 0;
  int64_t gradients = 0;
  int64_t optimizer = 0;
  int64_t buffers = 0;  // communication buffers (DDP buckets, gathered ZeRO units...)
  int64_t model_state() const { return parameters + gradients + optimizer; }
};

int64_t peak_rss_bytes();
std::string state_bytes_json(const StateBytes& s);
// Traffic per step: the counters divided by the number of steps.
std::string traffic_json(const comm::Traffic& total, int steps);
// Mixtures of experts: a step's routes per layer and expert, [layers,
// experts + 1] (the last column: routes dropped for capacity).
// The busiest expert's routes over the mean, the largest over the layers: 1
// is perfect balance, experts / top_k every token on the same experts.
double router_imbalance(const at::Tensor& load);
// The routes of each layer's experts as JSON: [[e0, e1, ...], ...].
std::string router_load_json(const at::Tensor& load);
int64_t routes_dropped(const at::Tensor& load);
// A small plot of the values for a terminal.
std::string ascii_plot(const std::vector<double>& values, int width = 60, int height = 10);
// The loss curve as an SVG file.
void write_svg_plot(const std::string& path, const std::vector<double>& values, const std::string& title);

// TensorBoard's event files, as torch.utils.tensorboard's SummaryWriter
// writes them: scalars by tag and step in DIR/events.out.tfevents.<time>.<host>
// (TFRecord framing with masked CRC32C, tensorflow.Event protobufs), so
// `tensorboard --logdir DIR` plots a run. Each scalar is flushed as written,
// so a killed run keeps what it logged. One writer per file; not thread-safe.
class SummaryWriter {
 public:
  explicit SummaryWriter(const std::string& dir);  // creates DIR
  ~SummaryWriter();
  SummaryWriter(const SummaryWriter&) = delete;
  SummaryWriter& operator=(const SummaryWriter&) = delete;
  void add_scalar(const std::string& tag, double value, int64_t step);
  const std::string& path() const { return path_; }

 private:
  void write_record(const std::string& event);
  std::string path_;
  std::FILE* file_ = nullptr;
};

// ===== checkpoint =====
// Sharded, atomic checkpoints that load under any layout.
//
// Saving: every rank writes only what it owns — its parameters (one replica
// per data-parallel group), its shard of the optimizer state, its RNG state —
// as chunks in layout-independent coordinates (parameter, kind, the tp slab of
// the full tensor, a flat offset within it). See Note [Atomic checkpoints] in
// checkpoint.cpp for the commit protocol: a checkpoint is complete only once
// its manifest (layout, step, SHA-256 of every shard) has been renamed into
// place, and `latest` only ever names complete checkpoints.
//
// Loading: each rank reads, from whichever shards hold them, the full tensors
// of the parameters it holds under the *new* layout, verifying every shard's
// checksum, and takes its part: dp, tp, pp and the ZeRO stage may all differ
// from the saving run's.

// One piece of training state in layout-independent coordinates.
struct StateChunk {
  std::string param;  // the single-process model's parameter name
  std::string kind;   // "value", or an optimizer state ("exp_avg", "exp_avg_sq", "momentum_buffer", ...)
  std::vector<int64_t> full_shape;
  int64_t tp_dim = -1;  // the full tensor is cut into tp_size slabs along tp_dim (-1: not cut)
  int tp_index = 0;
  int tp_size = 1;
  int64_t offset = 0;  // flat offset of `data` within its slab
  at::Tensor data;     // 1-D
};

// What one rank writes.
struct RankState {
  std::vector<StateChunk> chunks;
  std::map<std::string, int64_t> steps;  // optimizer step counts by parameter
  at::Tensor rng_state;                  // libtorch's CPU generator (cpu_rng_state()); undefined: none
};

// The default CPU generator's state (torch.get_rng_state()) and its restore.
using meshtrain::cpu_rng_state;  // meshtrain/util.h
using meshtrain::set_cpu_rng_state;

struct SaveStats {
  double seconds = 0;  // the training loop was blocked this long
  int64_t bytes = 0;   // this rank's shard
};

// Collective over `comm` (every rank of the job): writes step-NNNNNNNN/ in dir
// and commits it. Throws on every rank if any rank failed to write. Each shard
// is a torch.save archive of a dict of 1-D tensors ("c0", "c1", ..., "rng"),
// which PyTorch's `torch.load` opens; the manifest gives each key's coordinates
// (docs/checkpoints.md, tools/checkpoint_to_torch.py).
SaveStats save_checkpoint(const std::string& dir, int64_t step, const RankState& mine, comm::Communicator& comm,
                          const std::string& config_json);

// For saves in the background: a copy of the state at the step boundary
// (training may change the tensors afterwards) to hand to save_checkpoint on
// another thread, with its own communicator. The copy goes into the buffers of
// the previous one when the shapes match: faulting in fresh pages costs more
// than the copy itself. Valid until the next take().
class StateSnapshot {
 public:
  const RankState& take(const RankState& live);

 private:
  RankState copy_;
};

// The step directory `latest` names ("" when dir has no `latest`).
std::string latest_checkpoint(const std::string& dir);
// The step directories of `dir` that have a manifest (committed), newest first.
std::vector<std::string> complete_checkpoints(const std::string& dir);
// After a commit (one rank): removes committed checkpoints older than the
// newest `keep_last` (0: none), never the one `latest` names, and step
// directories without a manifest older than the newest committed one (left by
// a crash mid-save). Returns the directories removed.
std::vector<std::string> prune_checkpoints(const std::string& dir, int keep_last);
// Before a run's first save (one rank): removes every step directory without a
// manifest, which only a crashed save can have left (a kill -9 mid-write).
std::vector<std::string> remove_unfinished_saves(const std::string& dir);

class CheckpointReader {
 public:
  // Reads the manifest of a step directory. ConfigError when it is missing or malformed.
  explicit CheckpointReader(const std::string& step_dir);
  int64_t step() const { return step_; }
  const std::string& directory() const { return dir_; }
  const json::Value& config() const { return manifest_["config"]; }
  // The full tensor of (param, kind), assembled from the shards that hold it
  // (each verified against its SHA-256 on first use); undefined when absent.
  at::Tensor full(const std::string& param, const std::string& kind);
  std::optional<int64_t> optimizer_step(const std::string& param) const;
  // Reads every shard and checks its size and SHA-256 against the manifest
  // (without keeping it); ConfigError naming the first file that differs.
  void verify() const;
  bool has(const std::string& param) const;
  // The world size of the run that saved it, and the RNG state its rank
  // `rank` saved (undefined when that shard has none).
  int world_size() const { return static_cast<int>(manifest_["world_size"].i64()); }
  at::Tensor rng_state(int rank);

 private:
  const std::map<std::string, at::Tensor>& shard(size_t index);
  std::string dir_;
  json::Value manifest_;
  int64_t step_ = 0;
  std::map<size_t, std::map<std::string, at::Tensor>> loaded_;
  std::map<std::string, int64_t> steps_;
};

// Test hook: MESHTRAIN_CHECKPOINT_CRASH_AT=<stage> (with MESHTRAIN_CHECKPOINT_CRASH_RANK,
// default 0) kills the process with SIGKILL at that stage of a save: "shard-written",
// "shard-renamed", "manifest-written", "manifest-renamed", "latest-written";
// MESHTRAIN_CRASH_ONLY_AT_STEP restricts it to the save of one step.
void crash_point(const char* stage, int rank, int64_t step);

// ===== clip =====
// Global gradient-norm clipping for sharded and replicated gradients: what
// torch.nn.utils.clip_grad_norm_ computes on one process, on any layout.
//
// The norm is the L2 norm of the whole model's gradient with every element
// counted exactly once, wherever it lives: whole on every data-parallel
// replica (DDP: counted by dp rank 0), sharded over the data axis (ZeRO 1-3:
// each rank counts the reduced shard it steps), split over the tensor-parallel
// axis (column/row-parallel weights: every tp rank counts its slice) or
// replicated on it (layer norms, row-parallel biases: counted by tp rank 0),
// one pipeline stage each (a tied embedding is counted by the stage that owns
// it). Each rank sums the squares of the parts it counts; one all-reduce of a
// scalar over every rank that holds any part adds them; every rank then scales
// all of its parts, counted or not, by min(1, max_norm / (norm + 1e-6)), as
// PyTorch does. Squares are summed in float64.
//
//   // DDP or plain training, tensor-parallel layers included:
//   double norm = train::clip_grad_norm(*model, 1.0, mesh);
//   // ZeRO: the shards the optimizer steps
//   double norm = train::clip_grad_norm(
//       train::count_once(zero.shard_gradients(), tp::shard_dims(*model), false, mesh.coord()), 1.0, *mesh.world());

struct GradPart {
  at::Tensor grad;
  bool counted = true;  // false: another rank holds the same values and counts them
};

using NamedGrads = std::vector<std::pair<std::string, at::Tensor>>;

// The global norm of the counted parts over `group` (a collective: every rank
// of the group calls it, with or without parts). Scales every part when the
// norm exceeds max_norm; max_norm <= 0 only measures. Returns the norm before
// clipping (inf or nan when a gradient is not finite; then nothing is scaled).
double clip_grad_norm(const std::vector<GradPart>& parts, double max_norm, comm::Communicator& group);
// The same with the squares summed exactly (Note [Exact sum of squares] in
// util/exact_sum.h): the norm's bits do not depend on how the elements are
// split over ranks (train::TrainerOptions::deterministic). Float parts only.
double clip_grad_norm_exact(const std::vector<GradPart>& parts, double max_norm, comm::Communicator& group);

// Which of this rank's gradients (by parameter name) it counts: those split
// over tp (a dimension >= 0 in `tp_dims`, as tp::shard_dims gives) or on tp rank 0, and, when every dp rank holds
// the same values (`replicated_over_dp`), only on dp rank 0.
std::vector<GradPart> count_once(const NamedGrads& grads, const std::map<std::string, int64_t>& tp_dims,
                                 bool replicated_over_dp, const mesh::Coord& at);

// A module whose gradients are whole on every data-parallel rank (plain or DDP
// training, tensor-parallel layers included), on `mesh`.
double clip_grad_norm(const torch::nn::Module& module, double max_norm, const mesh::DeviceMesh& mesh);

}  // namespace train

// ===== module trainer =====
// train::Trainer: a model trained on a device mesh with every strategy,
// assembled from the public calls alone (what the examples write by hand).
// A user's model, whole on every rank:
//
//   mesh::DeviceMesh mesh(world, mesh::MeshLayout(world->size(), mesh::MeshDims().dp(dp).pp(pp).tp(tp)));
//   train::Trainer trainer(my_sequential, mesh, my_loss,
//                          [](std::vector<at::Tensor> p) { return std::make_unique<torch::optim::AdamW>(p, 1e-3); },
//                          train::TrainerOptions().zero(3).tp_plan(plan).pipeline(pp::PipelineOptions().microbatches(8)));
//   for (...) double loss = trainer.step(x, y);   // x, y: this dp rank's samples
//
// or the stages this rank builds itself (a model too large to build whole;
// the built-in trainer, run_training, builds its GPT and MLP so):
//
//   train::Trainer trainer({pp::stage_module(my_stage)}, mesh, my_loss, make_optimizer, options);
//
// What it does, in order:
//   tensor    tp::parallelize(model, mesh.tp(), tp_plan, tp_options) when tp > 1
//             (a whole model; built stages come cut as the caller wants)
//   pipeline  pp::pipeline over the model or the built stages when pp > 1 or
//             with virtual stages; a whole model is split where a balanced
//             split cuts the uncut model unless split_points are given;
//             ZeRO-2/3 reduce every micro-batch (reduce_every_microbatch);
//             this rank keeps its stage only (drop your own handle to the
//             model to free the rest)
//   data      per chunk (the stage, or each chunk under virtual stages): ZeRO 0:
//             DistributedDataParallel (dp > 1); 1 and 2: a
//             zero::ZeroRedundancyOptimizer; 3: zero::fully_shard on each
//             child with parameters (a ModuleDict's or ModuleList's children
//             each), then on the chunk when children share a parameter (a
//             tied embedding and head: one unit, kept gathered through the
//             step). Under ZeRO-3 each chunk has its own communicator over
//             the dp ranks, so a chunk's backward settles its own units only
//   precision param_dtype (at::kBFloat16): compute in it, step float32: DDP
//             through fp32 master weights (train/mixed_precision.h), ZeRO and
//             fully_shard through their param_dtype; float inputs enter in it
//   optimizer make_optimizer(the parameters a chunk's optimizer steps), once per chunk
//   clipping  with clip_grad_norm, the global norm counted once across the
//             layout (meshtrain/train.h)
//
// Micro-batches (PipelineOptions::microbatches) split the batch with or
// without a pipeline: without one the gradients accumulate over them, and the
// wrappers reduce on the last (ZeRO-2/3: on every one), as DeepSpeed does.
// Every dp rank passes the same number of samples (the loss and the gradients
// are means of the ranks' means).

namespace models {
struct ModelConfig;
}  // namespace models
namespace train {

using TpPlan = std::map<std::string, tp::Style>;

struct TrainerOptions {
  TORCH_ARG(int, zero) = 0;  // ZeRO stage along dp: 0 (DDP), 1, 2 or 3
  TORCH_ARG(TpPlan, tp_plan) = {};
  TORCH_ARG(tp::ParallelizeOptions, tp_options) = {};
  // Schedule, micro-batches (also without a pipeline: gradient accumulation),
  // virtual stages, split points, tied parameters of built stages.
  TORCH_ARG(pp::PipelineOptions, pipeline) = {};
  TORCH_ARG(dp::DistributedDataParallelOptions, ddp) = {};  // ZeRO 0
  TORCH_ARG(zero::ZeroOptions, zero_options) = {};  // ZeRO-1/2 (the stage comes from zero)
  // Mixed precision: the dtype to compute and communicate in (at::kBFloat16);
  // the optimizer steps float32. The loss function gets the output in it.
  TORCH_ARG(c10::optional<at::ScalarType>, param_dtype) = c10::nullopt;
  // ZeRO-3: units (their paths in the chunk: "embed", "blocks.0") that stay
  // gathered through the step, as FullyShardOptions::reshard_after_forward(false):
  // a module whose weight another reads outside its own forward. A path that
  // no pipeline stage holds is refused.
  TORCH_ARG(std::vector<std::string>, keep_gathered) = {};
  // Clip the global gradient norm, every element counted once across the
  // layout (meshtrain/train.h), as torch::nn::utils::clip_grad_norm_ on one
  // process; 0: not clipped.
  TORCH_ARG(double, clip_grad_norm) = 0;
  // Measure the global gradient norm every step (last_grad_norm) even when not
  // clipping: one small all-reduce over the world per step.
  TORCH_ARG(bool, measure_grad_norm) = false;
  // Deterministic mode (issue 33; Note [Deterministic training] in
  // src/train/module_trainer.cpp): the global batch is `grains` grains (a
  // power of two), each a micro-batch, and their gradients, losses and the
  // gradient norm are summed in one fixed tree, so every dp size that is a
  // power of two dividing `grains` (DDP, ZeRO-1/2/3, with or without a
  // pipeline) gives one process's bits. Rank r's micro-batch j must be grain
  // j * dp + r of the global batch (dp::grain_index; the built-in trainer
  // reads them so). The micro-batches per rank are grains / dp. Refused with
  // tensor parallelism (a split contraction's partial sums cannot follow one
  // process's order) and a DDP reduce dtype other than the parameters'. Sets
  // the process's intra-op and BLAS threads to `deterministic_threads` (the
  // same on every layout: BLAS blocking depends on it) and makes libtorch
  // refuse kernels without a deterministic implementation.
  TORCH_ARG(bool, deterministic) = false;
  TORCH_ARG(int, grains) = 0;
  TORCH_ARG(int, deterministic_threads) = 1;
  // Mixtures of experts (models::MoE, any depth of the model): the tokens
  // their balance loss covers, set on every layer. kGlobal: the step's whole
  // batch over dp x cp and the micro-batches, every layout training like one
  // process (Note [Global-batch balance loss] in meshtrain/moe.h); needs
  // every forward of a step before its first backward: gradient accumulation
  // then holds the micro-batches' activations together (as GPipe does), and a
  // pipeline schedule that runs a backward before the step's last forward
  // (1f1b, interleaved, naive with several micro-batches) is refused while a
  // layer has an aux_loss_coef. kMicro: each micro-batch's own on each rank
  // (Megatron-LM's and DeepSpeed's), scaled by 1 / micro-batches.
  TORCH_ARG(models::AuxLossScope, aux_loss_scope) = models::AuxLossScope::kGlobal;
};

class Trainer {
 public:
  using Loss = pp::PipelineLoss;
  using MakeOptimizer = std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<at::Tensor>)>;

  // Every rank passes the same model (same values: build it after the same seed).
  Trainer(torch::nn::Sequential model, const mesh::DeviceMesh& mesh, Loss loss, MakeOptimizer make_optimizer,
          TrainerOptions options = {});
  // The stages this rank builds: my_stages[k] is stage pp_rank + k * pp of
  // pp x virtual_stages (one without a pipeline), as pp::Pipeline's second
  // constructor takes them; parameters shared across stages are declared in
  // options.pipeline().tied(). tp_plan does not apply.
  Trainer(std::vector<pp::StageModule> my_stages, const mesh::DeviceMesh& mesh, Loss loss,
          MakeOptimizer make_optimizer, TrainerOptions options = {});
  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;
  Trainer(Trainer&&) noexcept;
  Trainer& operator=(Trainer&&) noexcept;

  // One optimizer step on this dp rank's samples (the ranks of one pp x tp
  // group pass the same ones; a pipeline reads the inputs on its first stage,
  // the targets on its last). Returns the mean loss over the dp ranks'
  // batches, on every rank (averaged over a communicator of its own, so the
  // axes' traffic is the training's alone).
  double step(const at::Tensor& inputs, const at::Tensor& targets);
  // The mean loss over the dp ranks' batches without training (no gradients,
  // no step), on every rank: a validation loss. The modules are in eval mode
  // meanwhile (Dropout off, BatchNorm's running statistics read); the batch
  // goes through in the micro-batches, one at a time (through a pipeline's
  // stages in order, pp::Pipeline::evaluate).
  double evaluate(const at::Tensor& inputs, const at::Tensor& targets);
  // Every optimizer uses `lr` from the next step on.
  void set_learning_rate(double lr);

  // The last step's global gradient norm before clipping (0 when neither
  // clipped nor measured).
  double last_grad_norm() const;
  // This rank's part of the model (its pipeline stage, or the whole model).
  const std::shared_ptr<torch::nn::Module>& module() const;
  // This rank's parameters at full size along dp, by the model's names (tp
  // slices stay sliced; mixed precision: the float32 masters), on dp rank 0
  // (the others get none). Every rank calls it.
  std::map<std::string, at::Tensor> parameters_over_dp();
  // The whole model's parameters (tp slices joined, every stage), on world
  // rank 0 (the others get none). Every rank calls it.
  std::map<std::string, at::Tensor> full_parameters();

  // Checkpoints (meshtrain/train.h): this rank's share of the parameters and
  // optimizer state (replicas written once, shards by their holders), and
  // loading it back under any layout.
  RankState checkpoint_state();
  void load_checkpoint(CheckpointReader& reader);

  // Figures: bytes of training state this rank holds; traffic by mesh axis
  // ("dp", "pp", "tp") since reset_traffic (reset through it, not the
  // communicators), evaluate's left out (under ZeRO-3 a unit it leaves
  // gathered saves the next step its gather); the pipeline's last timeline
  // and the most activations it held.
  StateBytes held_bytes() const;
  std::map<std::string, comm::Traffic> traffic_by_axis() const;
  void reset_traffic();
  std::vector<pp::TraceEvent> last_trace() const;
  int max_activations_in_flight() const;

 private:
  struct State;
  std::unique_ptr<State> s_;
};

// The loss of a built-in model (models::loss) on a mesh: under tensor
// parallelism (tp of more than one rank) the head's logits hold this rank's
// vocabulary rows (models::tp_plan cuts the head by vocabulary), and the
// cross-entropy is tp::vocab_parallel_cross_entropy over tp, the logits never
// gathered; otherwise models::loss.
Trainer::Loss model_loss(const models::ModelConfig& config, comm::CommPtr tp);

}  // namespace train
}  // namespace meshtrain
