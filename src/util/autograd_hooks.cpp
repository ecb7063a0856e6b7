#include "util/autograd_hooks.h"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

namespace meshtrain {
namespace hooks {

namespace {

class GradReadyHook : public torch::autograd::FunctionPostHook {
 public:
  GradReadyHook(std::weak_ptr<void> owner, std::function<void(size_t)> fn, size_t index)
      : owner_(std::move(owner)), fn_(std::move(fn)), index_(index) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override {
    if (auto alive = owner_.lock()) fn_(index_);
    return outputs;
  }

 private:
  std::weak_ptr<void> owner_;
  std::function<void(size_t)> fn_;
  size_t index_;
};

}  // namespace

std::vector<std::shared_ptr<torch::autograd::Node>> on_grad_ready(const std::vector<at::Tensor>& params,
                                                                  std::weak_ptr<void> owner,
                                                                  std::function<void(size_t)> on_ready) {
  std::vector<std::shared_ptr<torch::autograd::Node>> nodes;
  for (size_t i = 0; i < params.size(); ++i) {
    auto acc = torch::autograd::impl::grad_accumulator(params[i]);
    acc->add_post_hook(std::make_unique<GradReadyHook>(owner, on_ready, i));
    nodes.push_back(std::move(acc));
  }
  return nodes;
}

void at_end_of_backward(std::weak_ptr<void> owner, std::function<void()> fn) {
  torch::autograd::Engine::get_default_engine().queue_callback([owner, fn] {
    if (auto alive = owner.lock()) fn();
  });
}

}  // namespace hooks
}  // namespace meshtrain
