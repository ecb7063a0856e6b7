#pragma once
// The trainer consults the planner before it allocates anything: a model that
// cannot fit is refused with the estimate and a layout that fits, instead of
// an allocation failure minutes later (or a machine swapping).

#include <cstdint>
#include <string>

#include "meshtrain/plan.h"
#include "app/trainer/config.h"

namespace meshtrain {
namespace train {

// The memory this machine can give the job: MemAvailable, or the cgroup's
// limit minus its usage when that is lower.
int64_t available_memory_bytes();

// The machine's memory (MemTotal, or the cgroup's limit when lower): a
// figure every rank of a node reads alike, for choosing a layout.
int64_t total_memory_bytes();

// The planner's shape of a language model (gpt, gpt2, llama), its defaults
// applied; ConfigError for the MLP.
plan::DecoderShape decoder_shape(const models::ModelConfig& model);

// What the planner needs to know of the configuration, on `devices` devices
// of `device_memory` bytes each.
plan::PlanInput planner_input(const TrainConfig& config, int devices, int64_t device_memory);

// The planner's per-rank estimate (model state, activations, buffers) for the
// resolved configuration.
int64_t estimated_rank_bytes(const TrainConfig& resolved);

// ConfigError when `local_ranks` ranks of the estimated size exceed
// `available_bytes`, naming the estimate, what is available, and what the
// planner suggests for `world_size` ranks (or that more machines are needed).
void check_memory_fits(const TrainConfig& resolved, int world_size, int local_ranks, int64_t available_bytes);

}  // namespace train
}  // namespace meshtrain
