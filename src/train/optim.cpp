#include "meshtrain/train/optim.h"

#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include "meshtrain/util/error.h"

namespace meshtrain {
namespace train {

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const TrainConfig& c, std::vector<at::Tensor> params) {
  if (c.optimizer == "sgd") {
    return std::make_unique<torch::optim::SGD>(
        params, torch::optim::SGDOptions(c.lr).momentum(c.momentum).weight_decay(c.weight_decay));
  }
  if (c.optimizer == "adam") {
    return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(c.lr).weight_decay(c.weight_decay).eps(c.adam_eps));
  }
  MESHTRAIN_CHECK(c.optimizer == "adamw", "unknown optimizer '", c.optimizer, "'");
  return std::make_unique<torch::optim::AdamW>(params, torch::optim::AdamWOptions(c.lr).weight_decay(c.weight_decay).eps(c.adam_eps));
}

void set_learning_rate(torch::optim::Optimizer& optimizer, double lr) {
  for (auto& group : optimizer.param_groups()) group.options().set_lr(lr);
}

int64_t optimizer_state_bytes(const torch::optim::Optimizer& optimizer) {
  int64_t bytes = 0;
  auto add = [&](const at::Tensor& t) {
    if (t.defined()) bytes += t.nbytes();
  };
  for (const auto& kv : optimizer.state()) {
    const auto* s = kv.second.get();
    if (auto* a = dynamic_cast<const torch::optim::AdamWParamState*>(s)) {
      add(a->exp_avg());
      add(a->exp_avg_sq());
      add(a->max_exp_avg_sq());
    } else if (auto* b = dynamic_cast<const torch::optim::AdamParamState*>(s)) {
      add(b->exp_avg());
      add(b->exp_avg_sq());
      add(b->max_exp_avg_sq());
    } else if (auto* g = dynamic_cast<const torch::optim::SGDParamState*>(s)) {
      add(g->momentum_buffer());
    }
  }
  return bytes;
}

}  // namespace train
}  // namespace meshtrain
