#pragma once
// What the strategies give a mixture of experts from outside (models::MoE
// implements both interfaces; a user's own MoE layer can too):
//
//   TokenStatistics  a layer whose statistics span whole sequences (the
//                    balance loss counts every token of them): context
//                    parallelism (cp::parallelize) tells it the ranks that
//                    hold the same sequences' other tokens
//   ExpertParallel   a layer whose experts can be spread over ranks, each
//                    holding a slice: expert parallelism (ep::parallelize)
//                    gives it an ExpertGroup, which moves routed rows to the
//                    ranks holding their experts and back
//
// The interfaces hold no communicator (nn sits below communication): the
// strategies implement them over theirs.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

namespace meshtrain {
namespace nn {

class TokenStatistics {
 public:
  // Sums a tensor in place over the group; every rank of the group calls it
  // at the same point of its step (a collective).
  using Sum = std::function<void(at::Tensor&)>;
  virtual ~TokenStatistics() = default;
  // The `members` ranks `sum` sums over hold the other tokens of this rank's
  // sequences.
  virtual void set_token_group(Sum sum, int members) = 0;
};

// Rows moved between the ranks of an ExpertGroup: the rows a rank received,
// in rank order, and how many came from each rank.
struct Exchanged {
  at::Tensor rows;
  std::vector<int64_t> counts;
};

// Ranks that each hold one of size() equal slices of a layer's experts.
class ExpertGroup {
 public:
  virtual ~ExpertGroup() = default;
  virtual int size() const = 0;
  virtual int rank() const = 0;
  // rows [sum(send_counts), ...]: the first send_counts[0] rows go to rank 0,
  // the next send_counts[1] to rank 1, ... Autograd-aware (the gradient of
  // the received rows goes back to their senders the same way); every rank
  // of the group calls it (a collective).
  virtual Exchanged exchange(const at::Tensor& rows, const std::vector<int64_t>& send_counts) = 0;
};

class ExpertParallel {
 public:
  virtual ~ExpertParallel() = default;
  // Keeps this rank's slice of the experts (slice group->rank() of
  // group->size()) and sends each route to the rank holding its expert.
  virtual void parallelize_experts(std::shared_ptr<ExpertGroup> group) = 0;
  virtual int64_t num_experts() const = 0;  // every rank's, whole
  // The group given, or null (every expert here).
  virtual const std::shared_ptr<ExpertGroup>& expert_group() const = 0;
};

}  // namespace nn
}  // namespace meshtrain
