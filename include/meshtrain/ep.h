#pragma once
// meshtrain/ep.h: expert parallelism for nn::ExpertParallel modules.
// Part of the public API (meshtrain/meshtrain.h includes it); the sections below
// are in dependency order.

#include <torch/nn/module.h>

#include "meshtrain/comm.h"
#include "meshtrain/nn.h"

// ===== parallelize =====
// ep::parallelize: expert parallelism applied to a model from outside, its
// forward code left as it is:
//
//   ep::parallelize(*model, ep_comm);   // every models::MoE keeps experts / ep of its experts
//
// Every layer of the model that implements nn::ExpertParallel (models::MoE;
// meshtrain/nn.h) keeps its slice of the experts (rank r of ep: experts
// [E/ep r, E/ep (r+1)), ep::expert_slice) and sends each routed token to the
// rank holding its expert and back (all_to_all_rows over `ep`); the router
// stays replicated. The ranks of `ep` hold different tokens (data-parallel or
// context-parallel ranks: train::Trainer makes the ep group of consecutive
// ranks of dp x cp), and each expert's gradient is the mean over the group's
// losses, as a data-parallel gradient is (meshtrain/moe.h says why the experts
// are then held apart from the module's parameters). Every expert count must
// divide by ep (checked, naming the valid choices, before anything changes).
// Returns the number of layers it spread; an ep of size 1 (or null) changes
// nothing. Apply once, after loading any weights (the experts are sliced into
// new tensors) and before activation checkpointing or a data-parallel wrapper
// takes the module's parameters.

namespace meshtrain {
namespace ep {

int parallelize(torch::nn::Module& model, const comm::CommPtr& ep);

// The expert group ep::parallelize gives a layer: rows exchanged over a
// communicator.
class CommExpertGroup : public nn::ExpertGroup {
 public:
  explicit CommExpertGroup(comm::CommPtr comm);
  int size() const override { return comm_->size(); }
  int rank() const override { return comm_->rank(); }
  nn::Exchanged exchange(const at::Tensor& rows, const std::vector<int64_t>& send_counts) override;
  const comm::CommPtr& communicator() const { return comm_; }

 private:
  comm::CommPtr comm_;
};

// The communicator of a group ep::parallelize made; null for any other group.
comm::CommPtr communicator_of(const nn::ExpertGroup& group);

}  // namespace ep
}  // namespace meshtrain
