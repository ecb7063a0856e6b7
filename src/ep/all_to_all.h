#pragma once
// Expert parallelism's transport: rows of tokens sent to the ranks that hold
// their experts and back (DeepSpeed-MoE's and Megatron's dispatch and
// combine), over the Communicator's variable-size all_to_all.

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

#include "meshtrain/comm.h"
#include "meshtrain/nn.h"

namespace meshtrain {
namespace ep {

// Experts [first, first + count) of `experts` live on ep_rank. ConfigError
// naming the valid choices unless ep_size divides experts.
struct ExpertSlice {
  int64_t first = 0, count = 0;
};
ExpertSlice expert_slice(int64_t experts, int ep_size, int ep_rank);

// rows [sum(send_counts), ...]: the first send_counts[0] rows go to rank 0,
// the next send_counts[1] to rank 1, ... Returns the rows received, in rank
// order, and how many came from each rank. Autograd-aware: the gradient of
// the received rows goes back to their senders the same way. Every rank of
// `ep` calls it (a collective).
using Exchanged = nn::Exchanged;
Exchanged all_to_all_rows(const at::Tensor& rows, const std::vector<int64_t>& send_counts, const comm::CommPtr& ep);

}  // namespace ep
}  // namespace meshtrain
