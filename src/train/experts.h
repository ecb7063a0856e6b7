#pragma once
// Expert parallelism in train::Trainer (internal). Under ep > 1 a mixture of
// experts holds its experts' weights apart from its parameters
// (models::MoEImpl::expert_parameters), so that the chunks' wrappers along
// dp x cp (DDP, ZeRO 1-3), which average over ranks holding *other* experts,
// never see them. The trainer gathers them into one module of their own,
// nested by their full names ("blocks.3.moe.gate"), and trains it as a chunk
// of its own over the expert replicas, the ranks of dp x cp with the same ep
// rank, which hold the same experts: DDP, or ZeRO-1/2 (ZeRO-2 under ZeRO-3;
// make_expert_chunk_trainer). Their gradients arrive as
// the mean over the ep group's losses (the layer scales them by 1 / ep), so
// that the replicas' average is the mean over all of dp x cp, as for every
// other parameter.

#include <torch/nn/module.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "chunk.h"
#include "meshtrain/comm.h"

namespace meshtrain {
namespace train {

struct HeldApartExperts {
  std::shared_ptr<torch::nn::Module> module;  // null: no experts held apart on this rank
  comm::CommPtr ep;                           // the group the layers spread their experts over
};

// The experts the MoE layers of `units` hold apart, as one module. All of
// them must use the same ep group.
HeldApartExperts held_apart_experts(const std::vector<std::shared_ptr<torch::nn::Module>>& units);

// Where the experts' tensors sit in the full model: the slice of dimension 0
// (the expert dimension) of this ep rank, written once per replica group.
ShardPlace expert_place(const torch::nn::Module& experts, const comm::Communicator& ep,
                        const comm::Communicator& replicas);

// The whole expert tensors from every ep rank's slices, concatenated along the
// expert dimension (a collective over ep).
std::map<std::string, at::Tensor> gather_experts(const std::map<std::string, at::Tensor>& mine,
                                                 comm::Communicator& ep);

}  // namespace train
}  // namespace meshtrain
