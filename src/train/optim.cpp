#include "train/optim.h"

#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include "meshtrain/util.h"

namespace meshtrain {
namespace train {

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
