#include "meshtrain/models/stage.h"

namespace meshtrain {
namespace models {

torch::nn::ModuleDict StageImpl::dict(const std::string& group) {
  for (const auto& child : named_children()) {
    if (child.key() == group) return torch::nn::ModuleDict(std::dynamic_pointer_cast<torch::nn::ModuleDictImpl>(child.value()));
  }
  return register_module(group, torch::nn::ModuleDict());
}

at::Tensor StageImpl::forward(at::Tensor x) { return forward_range(std::move(x), 0, pieces_.size()); }

at::Tensor StageImpl::forward_range(at::Tensor x, size_t first, size_t last) {
  for (size_t i = first; i < last; ++i) x = pieces_[i].forward(x);
  return x;
}

}  // namespace models
}  // namespace meshtrain
