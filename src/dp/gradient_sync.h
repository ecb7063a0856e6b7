#pragma once
// Who synchronizes a module's gradients, and a switch to pause it.
//
// A wrapper that reduces gradients across data-parallel ranks in backward
// (DistributedDataParallel / dp::replicate, ZeRO stages 1 and 2) registers
// itself here for the module it wraps. Code that runs several backwards per
// optimizer step without knowing the wrapper — a pipeline running its
// micro-batches (pp::pipeline), a gradient-accumulation loop — turns the
// reduction off for all but the last backward, as PyTorch's pipelining does
// with `set_requires_gradient_sync`. The explicit no_sync() guards do the
// same for code that holds the wrapper.

#include <torch/nn/module.h>

#include <functional>
#include <memory>

namespace meshtrain {
namespace dp {

// While `owner` lives, set_gradient_sync(*module, on) calls set_sync(on).
// One wrapper per module: a second registration replaces the first.
void register_gradient_sync(const torch::nn::Module* module, std::weak_ptr<void> owner,
                            std::function<void(bool)> set_sync);
void unregister_gradient_sync(const torch::nn::Module* module);

// Turns on or off the gradient reduction of the wrappers registered for
// `module` and for each module inside it (as FSDP2's
// set_requires_gradient_sync(recurse=True): zero::fully_shard registers each
// sharded block). Returns false when none is registered (a no-op).
bool set_gradient_sync(const torch::nn::Module& module, bool on);

// Whether a live wrapper is registered for `module` itself.
bool has_gradient_sync(const torch::nn::Module& module);

}  // namespace dp
}  // namespace meshtrain
