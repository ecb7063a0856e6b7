#pragma once
// libtorch's default CPU generator, saved and restored whole: checkpoints
// keep it, and activation checkpointing replays the forward's draws.

#include <ATen/core/Tensor.h>

namespace meshtrain {

at::Tensor cpu_rng_state();
void set_cpu_rng_state(const at::Tensor& state);

}  // namespace meshtrain
