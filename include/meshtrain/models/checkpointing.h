#pragma once
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

#include <torch/nn/module.h>

#include <functional>
#include <string>
#include <vector>

#include "meshtrain/models/models.h"

namespace meshtrain {
namespace models {

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

}  // namespace models
}  // namespace meshtrain
