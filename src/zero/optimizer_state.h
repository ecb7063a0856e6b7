#pragma once
// Reading and writing a torch::optim optimizer's per-parameter state by name,
// and moving the optimizer onto shard pieces (ZeRO, checkpoints).

#include <torch/optim/optimizer.h>

#include <map>
#include <string>
#include <vector>

namespace meshtrain {
namespace zero {

// Throws ConfigError unless every step of `optimizer` is elementwise (the
// shard of the result is the result of the shard): SGD, Adam, AdamW, RMSprop, Adagrad.
void check_elementwise(const torch::optim::Optimizer& optimizer);

// The state of `param` as named tensors; "step" as an int64 scalar. Empty when
// the optimizer has no state for it yet.
std::map<std::string, at::Tensor> state_of(torch::optim::Optimizer& optimizer, const at::Tensor& param);
// Installs state for `param` (SGD, Adam, AdamW). Throws ConfigError for other types.
void set_state(torch::optim::Optimizer& optimizer, const at::Tensor& param,
               const std::map<std::string, at::Tensor>& state);

// Replaces the optimizer's parameters: group g gets pieces[i] for every i with
// group_of[i] == g. group_of is computed by group_of_params (by tensor identity).
void replace_params(torch::optim::Optimizer& optimizer, const std::vector<at::Tensor>& pieces,
                    const std::vector<int>& group_of);
// For each parameter, the index of the optimizer group holding it, or -1.
std::vector<int> group_of_params(const torch::optim::Optimizer& optimizer, const std::vector<at::Tensor>& params);

}  // namespace zero
}  // namespace meshtrain
