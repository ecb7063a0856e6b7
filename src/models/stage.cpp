#include "meshtrain/models.h"

#include "meshtrain/moe.h"
#include "meshtrain/util.h"

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
    x = checkpoint([piece](const at::Tensor& h) mutable { return piece.forward(h); }, x, *checkpointed_[i]);
  }
  return x;
}

void StageImpl::set_checkpointed(size_t i, bool on) {
  for (const auto& p : pieces_.at(i).ptr()->named_parameters()) {
    MESHTRAIN_CHECK(p.key().find("_fully_sharded") == std::string::npos, "activation checkpointing of piece ", i,
                    " after zero::fully_shard: its parameter list now holds the shard, not the parameters its layers "
                    "compute with; mark pieces for checkpointing before sharding them");
  }
  if (!on) {
    checkpointed_.at(i) = c10::nullopt;
    return;
  }
  // The recompute's gradients go to these: the parameters, and the experts a
  // mixture of experts holds apart under expert parallelism.
  std::vector<at::Tensor> params = pieces_.at(i).ptr()->parameters();
  for (const auto& m : pieces_.at(i).ptr()->modules())
    if (auto* moe = dynamic_cast<MoEImpl*>(m.get()))
      for (const auto& w : moe->expert_parameters()) params.push_back(w.second);
  checkpointed_.at(i) = std::move(params);
}

}  // namespace models
}  // namespace meshtrain
