#pragma once
// train::Trainer: a user's model trained on a device mesh with every strategy,
// assembled from the public calls alone (what the examples write by hand):
//
//   mesh::DeviceMesh mesh(world, mesh::MeshLayout(world->size(), dp, pp, tp));
//   train::Trainer trainer(my_sequential, mesh, my_loss,
//                          [](std::vector<at::Tensor> p) { return std::make_unique<torch::optim::AdamW>(p, 1e-3); },
//                          train::TrainerOptions().zero(3).tp_plan(plan).pipeline(pp::PipelineOptions().microbatches(8)));
//   for (...) double loss = trainer.step(x, y);   // x, y: this dp rank's samples
//
// What it does, in order:
//   tensor    tp::parallelize(model, mesh.tp(), tp_plan, tp_options) when tp > 1
//   pipeline  pp::pipeline(model, mesh.pp(), loss, pipeline) when pp > 1 or
//             with virtual stages, split where a balanced split cuts the
//             uncut model unless split_points are given; ZeRO-2/3 reduce
//             every micro-batch (reduce_every_microbatch); this rank keeps
//             its stage only (drop your own handle to the model to free the rest)
//   data      zero 0: dp::replicate per chunk; 1 and 2: a
//             zero::ZeroRedundancyOptimizer per chunk; 3: zero::fully_shard on
//             each child with parameters, then on the chunk when children
//             share a parameter (a tied embedding and head: one unit, kept
//             gathered through the step)
//   optimizer make_optimizer(the parameters it must step: this rank's part of
//             the model, each once; a chunk's under ZeRO-1/2; the shards
//             under ZeRO-3)
//   clipping  with clip_grad_norm, the global norm counted once across the
//             layout (train/clip.h), as the built-in trainer
//
// Every dp rank passes the same number of samples (the loss and the gradients
// are means of the ranks' means). Micro-batches apply to a pipeline only
// (without one the batch goes through in one forward). Under virtual stages
// the chunks share the dp communicator (the built-in trainer gives each its
// own: with ZeRO-3 each chunk's backward then also settles the other's units,
// more bytes, the same values).
//
// The built-in trainer (run_training, train/trainer.h) composes the same calls
// over the stages each rank builds of the built-in models, with checkpoints,
// metrics and mixed precision; this class takes a user's torch::nn::Sequential
// whole on every rank. Not here yet: checkpoints, bf16.

#include <torch/nn/modules/container/sequential.h>
#include <torch/optim/optimizer.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "meshtrain/mesh/mesh.h"
#include "meshtrain/pp/pipeline.h"
#include "meshtrain/tp/parallelize.h"
#include "meshtrain/zero/zero.h"

namespace meshtrain {
namespace train {

using TpPlan = std::map<std::string, tp::Style>;

struct TrainerOptions {
  TORCH_ARG(int, zero) = 0;  // ZeRO stage along dp: 0 (DDP), 1, 2 or 3
  TORCH_ARG(TpPlan, tp_plan) = {};
  TORCH_ARG(tp::ParallelizeOptions, tp_options) = {};
  TORCH_ARG(pp::PipelineOptions, pipeline) = {};
  TORCH_ARG(zero::ZeroOptions, zero_options) = {};  // ZeRO-1/2 (the stage comes from zero)
  // Clip the global gradient norm, every element counted once across the
  // layout (train/clip.h), as torch::nn::utils::clip_grad_norm_ on one
  // process; 0: neither measured nor clipped.
  TORCH_ARG(double, clip_grad_norm) = 0;
};

class Trainer {
 public:
  using Loss = pp::PipelineLoss;
  using MakeOptimizer = std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<at::Tensor>)>;

  // Every rank passes the same model (same values: build it after the same seed).
  Trainer(torch::nn::Sequential model, const mesh::DeviceMesh& mesh, Loss loss, MakeOptimizer make_optimizer,
          TrainerOptions options = {});
  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  // One optimizer step on this dp rank's samples (the ranks of one pp x tp
  // group pass the same ones). Returns the mean loss over the dp ranks' batches,
  // on every rank.
  double step(const at::Tensor& inputs, const at::Tensor& targets);

  // The last step's global gradient norm before clipping (0 without clip_grad_norm).
  double last_grad_norm() const;
  // This rank's part of the model (its pipeline stage, or the whole model).
  const std::shared_ptr<torch::nn::Module>& module() const;
  // This rank's parameters at full size along dp, by the model's names (tp
  // slices stay sliced); under ZeRO-1/2 on dp rank 0 only. Every rank calls it.
  std::map<std::string, at::Tensor> parameters_over_dp();

 private:
  struct State;
  std::unique_ptr<State> s_;
};

}  // namespace train
}  // namespace meshtrain
