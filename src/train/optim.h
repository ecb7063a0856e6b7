#pragma once
// What any optimizer needs beyond libtorch: its learning rate set, the bytes
// of its state. (The optimizer the trainer's flags name: app/trainer/optimizer.h.)

#include <torch/optim/optimizer.h>

#include <memory>
#include <vector>

#include <cstdint>

namespace meshtrain {
namespace train {

// Sets the learning rate of every parameter group.
void set_learning_rate(torch::optim::Optimizer& optimizer, double lr);
// Bytes of every tensor in the optimizer's per-parameter state (Adam's moments,
// SGD's momentum buffers, ...).
int64_t optimizer_state_bytes(const torch::optim::Optimizer& optimizer);

}  // namespace train
}  // namespace meshtrain
