#pragma once
// Optimizers from the trainer's flags, and the bytes of their state.

#include <torch/optim/optimizer.h>

#include <memory>
#include <vector>

#include "meshtrain/train/config.h"

namespace meshtrain {
namespace train {

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const TrainConfig& config, std::vector<at::Tensor> params);
// Sets the learning rate of every parameter group.
void set_learning_rate(torch::optim::Optimizer& optimizer, double lr);
// Bytes of every tensor in the optimizer's per-parameter state (Adam's moments,
// SGD's momentum buffers, ...).
int64_t optimizer_state_bytes(const torch::optim::Optimizer& optimizer);

}  // namespace train
}  // namespace meshtrain
