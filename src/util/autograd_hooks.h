#pragma once
// Hooks into libtorch's autograd engine, shared by DDP and ZeRO (internal).
// These use autograd internals that exist in libtorch 1.13 and 2.x and that
// c10d's reducer uses the same way.

#include <torch/csrc/autograd/function.h>

#include <functional>
#include <memory>
#include <vector>

namespace meshtrain {
namespace hooks {

// Calls on_ready(i) each time autograd has accumulated parameter i's gradient
// into .grad (a post hook on its AccumulateGrad node). `owner` must be alive
// for the callback to run (hooks cannot be removed in 1.13; they go quiet).
// Returns the AccumulateGrad nodes: keep them, they hold the hooks.
std::vector<std::shared_ptr<torch::autograd::Node>> on_grad_ready(
    const std::vector<at::Tensor>& params, std::weak_ptr<void> owner, std::function<void(size_t)> on_ready);

// Runs fn once the current backward pass has finished. Call during backward.
void at_end_of_backward(std::weak_ptr<void> owner, std::function<void()> fn);

}  // namespace hooks
}  // namespace meshtrain
