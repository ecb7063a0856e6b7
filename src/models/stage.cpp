#include "meshtrain/models/stage.h"

#include "meshtrain/models/checkpointing.h"

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
  for (size_t i = first; i < last; ++i) {
    if (!checkpointed_[i]) {
      x = pieces_[i].forward(x);
      continue;
    }
    torch::nn::AnyModule piece = pieces_[i];
    x = checkpoint([piece](const at::Tensor& h) mutable { return piece.forward(h); }, x, piece.ptr()->parameters());
  }
  return x;
}

}  // namespace models
}  // namespace meshtrain
