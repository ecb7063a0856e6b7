#include "app/trainer/optimizer.h"

#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include "meshtrain/util.h"

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

}  // namespace train
}  // namespace meshtrain
