#pragma once
// zero::fully_shard: ZeRO stage 3 (PyTorch's FSDP `fully_shard`) applied to a
// user's plain modules, the forward code left as it is:
//
//   for (auto& block : model->blocks) zero::fully_shard(*block, mesh.dp());
//   zero::fully_shard(*model, mesh.dp());                 // the rest: embeddings, head
//   torch::optim::AdamW adam(model->parameters(), 1e-3);  // now the shards
//   auto loss = loss_fn(model->forward(x), y);            // the module's own forward
//   loss.backward();                                      // gradients reduce-scattered here
//   adam.step();                                          // each rank steps its shard
//
// Each call makes one unit of the module's parameters that no earlier call
// took (shard children first, then the parent, as in PyTorch). A unit keeps
// one flat shard per rank, 1/N of its parameters (sizes need not divide). As
// with FSDP's flat parameters, the shard takes the parameters' place in the
// module's parameter list (registered as "_fully_sharded" in the module given
// to fully_shard), so module.parameters() is what an optimizer must step; the
// layers keep their parameter tensors at full shape, with their memory freed,
// and use them in forward as before. Names and full values: full_parameters.
// Between steps a rank holds 1/N of the parameters, gradients and optimizer
// state (ZeRO's 16 psi / N).
//
//   forward   the first operation that reads a unit's parameter all-gathers
//             the unit; the other gathered units of the same communicator are
//             freed then (reshard_after_forward), so about one unit is whole
//             at a time
//   backward  a unit is gathered again when its backward reads it; once all
//             its gradients are accumulated they are reduce-scattered
//             (averaged over the ranks) into the shard's .grad and the unit is
//             freed; at the end of backward every unit is freed, including
//             units whose parameters got no gradient (their shard gets zeros)
//   step      the optimizer changes the shards; a unit gathered before the
//             step is gathered again at its next use
//
// How, without forward hooks: the parameters carry a dispatch key libtorch
// 1.13 leaves unused (docs/design/forward-interception.md); tp::parallelize
// uses the same mechanism, and the two compose (a unit of tp slices). Every
// rank must run the same operations on sharded parameters, as it must call
// the same collectives: printing a parameter on one rank would gather on that
// rank alone (use full_parameters on every rank). Shard after Module::to(),
// which drops the key. Every rank must hold the same values to begin with:
// rank 0's are broadcast.
//
// Several backwards per step: each reduce-scatters, the shard's .grad adds
// them up; or dp::set_gradient_sync(module, false) (dp/gradient_sync.h; what
// pp::pipeline does between micro-batches) keeps full-size gradients in the
// parameters' .grad until a backward with sync on, for one reduce-scatter.
//
// Not yet: prefetching the next unit, and mixed precision (param_dtype).

#include <torch/arg.h>
#include <torch/nn/module.h>

#include <map>
#include <string>
#include <vector>

#include "meshtrain/comm/communicator.h"

namespace meshtrain {
namespace zero {

struct FullyShardOptions {
  // Free this unit when an operation starts on another unit (true), or keep it
  // gathered from its first use to the end of backward (false: the root's
  // embedding and head, used at both ends of the forward).
  TORCH_ARG(bool, reshard_after_forward) = true;
};

// Makes `module`'s not yet sharded parameters one unit over `dp`. Collective
// over dp (a broadcast from rank 0). Refused: a module with no such
// parameters, parameters that are views, and a weight tied to one an earlier
// call took (shard the modules sharing it in one call). tp::parallelize first.
void fully_shard(torch::nn::Module& module, const comm::CommPtr& dp, FullyShardOptions options = {});

// The flat shards of the units in `module`, in registration order (the
// sharded part of module.parameters(); one tensor per unit, so parameter
// groups per layer are not available).
std::vector<at::Tensor> sharded_parameters(const torch::nn::Module& module);

// Collective over dp: `module`'s parameters at full shape under their
// original names (sharded ones gathered, tied ones under each name; others
// as they are): for checkpoints and checks.
std::map<std::string, at::Tensor> full_parameters(const torch::nn::Module& module);

// Bytes of `module`'s parameters this rank holds now: the shards plus the
// storage of every gathered unit and of unsharded parameters.
int64_t held_parameter_bytes(const torch::nn::Module& module);

}  // namespace zero
}  // namespace meshtrain
