#pragma once
// The optimizer the trainer's flags name (--optimizer, --lr, --momentum,
// --weight-decay, --adam-eps); what any optimizer needs beyond that is in
// meshtrain/train/optim.h.

#include <torch/optim/optimizer.h>

#include <memory>
#include <vector>

#include "app/trainer/config.h"

namespace meshtrain {
namespace train {

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const TrainConfig& config, std::vector<at::Tensor> params);

}  // namespace train
}  // namespace meshtrain
