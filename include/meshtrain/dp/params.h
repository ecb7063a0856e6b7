#pragma once
// Parameter utilities shared by the data-parallel strategies (DDP, master DP,
// ZeRO): deduplicated parameter lists, a cross-rank check that every rank holds
// the same parameters, and coalesced broadcasts.

#include <torch/nn/module.h>

#include <string>
#include <vector>

#include "meshtrain/comm/communicator.h"

namespace meshtrain {
namespace dp {

struct NamedParam {
  std::string name;
  at::Tensor tensor;
};

// Parameters that require grad, each once even when shared (tied) between
// submodules; the first name wins.
std::vector<NamedParam> unique_parameters(const torch::nn::Module& module);
std::vector<NamedParam> unique_buffers(const torch::nn::Module& module);

// Verifies across `comm` that every rank has the same parameter names, shapes
// and dtypes. Throws ConfigError on every rank, naming the first mismatch and
// the ranks involved; never hangs on a mismatch.
void verify_same_parameters(comm::Communicator& comm, const std::vector<NamedParam>& params,
                            const std::string& who);

// Broadcasts tensors from root, coalesced into one flat buffer per dtype.
void broadcast_coalesced(comm::Communicator& comm, const std::vector<at::Tensor>& tensors, int root);

// Total bytes of the tensors.
int64_t total_bytes(const std::vector<at::Tensor>& tensors);

}  // namespace dp
}  // namespace meshtrain
