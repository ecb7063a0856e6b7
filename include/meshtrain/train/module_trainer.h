#pragma once
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
//             layout (train/clip.h)
//
// Micro-batches (PipelineOptions::microbatches) split the batch with or
// without a pipeline: without one the gradients accumulate over them, and the
// wrappers reduce on the last (ZeRO-2/3: on every one), as DeepSpeed does.
// Every dp rank passes the same number of samples (the loss and the gradients
// are means of the ranks' means).

#include <torch/nn/modules/container/sequential.h>
#include <torch/optim/optimizer.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "meshtrain/dp/ddp.h"
#include "meshtrain/mesh/mesh.h"
#include "meshtrain/models/moe_balance.h"
#include "meshtrain/pp/pipeline.h"
#include "meshtrain/tp/parallelize.h"
#include "meshtrain/train/checkpoint.h"
#include "meshtrain/train/metrics.h"
#include "meshtrain/zero/zero.h"

namespace meshtrain {
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
  // layout (train/clip.h), as torch::nn::utils::clip_grad_norm_ on one
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
  // process (Note [Global-batch balance loss] in models/moe_balance.h); needs
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

  // Checkpoints (train/checkpoint.h): this rank's share of the parameters and
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
