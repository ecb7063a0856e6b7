#pragma once
// Dense <-> sharded parameters of a module cut by tp::parallelize: which
// dimension each parameter is split along, every tp rank's parts gathered
// into the full tensors, and full tensors cut into a rank's parts (the
// trainer's consolidated weights and checkpoints; a user converting a model).

#include <torch/nn/module.h>

#include <map>
#include <string>

#include "meshtrain/comm.h"

namespace meshtrain {
namespace tp {

// For each parameter of `module`, the dimension tp::parallelize split it
// along (-1: replicated on every tp rank); also for layers whose parameters
// zero::fully_shard has taken out of the module's list (the layers keep them).
std::map<std::string, int64_t> shard_dims(const torch::nn::Module& module);
// The full tensors from every tp rank's parts (a collective over tp; parts
// may differ in size, as a vocabulary tp does not divide is cut).
std::map<std::string, at::Tensor> unshard(const std::map<std::string, at::Tensor>& local,
                                          const std::map<std::string, int64_t>& dims, comm::Communicator& tp);
// This rank's parts of full tensors, cut as tp::parallelize cuts them.
std::map<std::string, at::Tensor> shard(const std::map<std::string, at::Tensor>& full,
                                        const std::map<std::string, int64_t>& dims, int tp_rank, int tp_size);

}  // namespace tp
}  // namespace meshtrain
