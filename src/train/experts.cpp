#include "experts.h"

#include <ATen/ATen.h>

#include "meshtrain/ep.h"
#include "meshtrain/moe.h"
#include "meshtrain/util.h"

namespace meshtrain {
namespace train {

namespace {

// The module at `path` ("blocks.3.moe") below `root`, made where missing
// (register_parameter takes no dotted names).
torch::nn::Module& module_at(torch::nn::Module& root, const std::string& path) {
  torch::nn::Module* m = &root;
  size_t start = 0;
  while (start < path.size()) {
    const size_t dot = path.find('.', start);
    const std::string name = path.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
    std::shared_ptr<torch::nn::Module> child;
    for (const auto& c : m->named_children())
      if (c.key() == name) child = c.value();
    if (!child) child = m->register_module(name, std::make_shared<torch::nn::Module>());
    m = child.get();
    if (dot == std::string::npos) break;
    start = dot + 1;
  }
  return *m;
}

}  // namespace

HeldApartExperts held_apart_experts(const std::vector<std::shared_ptr<torch::nn::Module>>& units) {
  HeldApartExperts out;
  for (const auto& unit : units) {
    for (const auto& item : unit->named_modules()) {
      auto* moe = dynamic_cast<models::MoEImpl*>(item.value().get());
      if (!moe || moe->expert_parameters().empty()) continue;
      const comm::CommPtr group = moe->expert_group() ? ep::communicator_of(*moe->expert_group()) : nullptr;
      MESHTRAIN_CHECK(group, "train::Trainer: the mixture of experts '", item.key(), "' holds its experts apart over "
                      "a group that ep::parallelize did not make; spread the experts with ep::parallelize");
      MESHTRAIN_CHECK(!out.ep || out.ep == group, "train::Trainer: the mixture of experts '", item.key(),
                      "' spreads its experts over another ep group than this rank's other MoE layers; give every "
                      "layer the same group");
      out.ep = group;
      if (!out.module) out.module = std::make_shared<torch::nn::Module>();
      torch::nn::Module& at = module_at(*out.module, item.key());
      for (const auto& w : moe->expert_parameters()) at.register_parameter(w.first, w.second);
    }
  }
  return out;
}

ShardPlace expert_place(const torch::nn::Module& experts, const comm::Communicator& ep,
                        const comm::Communicator& replicas) {
  ShardPlace place;
  for (const auto& p : experts.named_parameters()) place.tp_dims[p.key()] = 0;
  place.tp_index = ep.rank();
  place.tp_size = ep.size();
  place.dp_rank = replicas.rank();
  place.dp_size = replicas.size();
  return place;
}

std::map<std::string, at::Tensor> gather_experts(const std::map<std::string, at::Tensor>& mine,
                                                 comm::Communicator& ep) {
  std::map<std::string, at::Tensor> out;
  for (const auto& kv : mine) out[kv.first] = at::cat(ep.all_gather(kv.second.contiguous()), 0);
  return out;
}

}  // namespace train
}  // namespace meshtrain
