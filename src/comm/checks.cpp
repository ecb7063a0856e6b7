// The argument checks every operation runs before any communication (checks.h).

#include "checks.h"

#include <ATen/ATen.h>

#include "header.h"
#include "meshtrain/util.h"
#include "util/shard.h"

namespace meshtrain {
namespace comm {

// ---- labels

std::string where(const Communicator& c, const char* op) {
  return str_cat(op, " on communicator '", c.label(), "' (rank ", c.rank(), " of ", c.size(), ", global rank ",
                 c.global_ranks()[c.rank()], ")");
}

std::string peer_name(const Communicator& c, int peer) {
  return str_cat("rank ", peer, " (global rank ", c.global_ranks()[peer], ")");
}

// ---- argument checks

void check_tensor(const Communicator& c, const at::Tensor& t, const char* op, const char* what) {
  MESHTRAIN_CHECK(t.defined(), where(c, op), ": ", what, " is an undefined tensor");
  MESHTRAIN_CHECK(t.device().is_cpu(), where(c, op), ": ", what, " is on ", t.device(), "; the ", c.backend(),
                  " backend moves CPU tensors only (call .cpu() first)");
  MESHTRAIN_CHECK(supported_dtype(t.scalar_type()), where(c, op), ": dtype ", t.scalar_type(),
                  " is not supported; use float32, float64, bfloat16, float16, int32, int64, int8 or uint8");
  MESHTRAIN_CHECK(t.dim() <= 8, where(c, op), ": ", what, " has ", t.dim(),
                  " dims; at most 8 are supported (reshape first)");
}

void check_root(const Communicator& c, int root, const char* op) {
  MESHTRAIN_CHECK(root >= 0 && root < c.size(), where(c, op), ": root ", root, " is not a rank of ",
                  "this communicator; use a root in [0, ", c.size(), ")");
}

void check_peer(const Communicator& c, int peer, const char* op) {
  MESHTRAIN_CHECK(peer >= 0 && peer < c.size() && peer != c.rank(), where(c, op), ": peer ", peer,
                  " is invalid; use a rank in [0, ", c.size(), ") other than this rank (", c.rank(), ")");
}

void check_reduce_op(const Communicator& c, ReduceOp op, const at::Tensor& t, const char* name) {
  MESHTRAIN_CHECK(op != ReduceOp::kAvg || at::isFloatingType(t.scalar_type()), where(c, name),
                  ": ReduceOp::kAvg needs a floating dtype, got ", t.scalar_type(), "; reduce with kSum and divide");
}

void check_p2p(const Communicator& c, const at::Tensor& tensor, int peer, int tag, const char* op) {
  check_tensor(c, tensor, op, "tensor");
  check_peer(c, peer, op);
  MESHTRAIN_CHECK(tag >= 0 && tag < (1 << 30), where(c, op), ": tag ", tag, " out of range [0, 2^30)");
}

void check_reduce_scatter(const Communicator& c, const at::Tensor& input, const at::Tensor& output,
                          std::vector<int64_t>& counts) {
  check_tensor(c, input, "reduce_scatter", "input");
  if (counts.empty()) counts = shard_sizes(input.numel(), c.size());
  int64_t sum = 0;
  for (auto count : counts) {
    MESHTRAIN_CHECK(count >= 0, where(c, "reduce_scatter"), ": negative shard size ", count);
    sum += count;
  }
  MESHTRAIN_CHECK(static_cast<int>(counts.size()) == c.size() && sum == input.numel(), where(c, "reduce_scatter"),
                  ": shard sizes must be one per rank (", c.size(), ") and sum to the input's ", input.numel(),
                  " elements; got ", counts.size(), " sizes summing to ", sum);
  if (output.defined()) {
    check_tensor(c, output, "reduce_scatter", "output");
    MESHTRAIN_CHECK(output.numel() == counts[c.rank()] && output.scalar_type() == input.scalar_type(),
                    where(c, "reduce_scatter"), ": output must be ", input.scalar_type(), " with ", counts[c.rank()],
                    " elements (this rank's shard); got ", output.scalar_type(), " with ", output.numel());
  }
}

void check_all_gather(const Communicator& c, const at::Tensor& input, const at::Tensor& output) {
  check_tensor(c, input, "all_gather", "input");
  if (output.defined()) {
    check_tensor(c, output, "all_gather", "output");
    MESHTRAIN_CHECK(output.scalar_type() == input.scalar_type(), where(c, "all_gather"), ": output dtype ",
                    output.scalar_type(), " differs from input dtype ", input.scalar_type());
  }
}

void check_scatter(const Communicator& c, const at::Tensor& output, const std::vector<at::Tensor>& inputs,
                   int root) {
  check_tensor(c, output, "scatter", "output");
  check_root(c, root, "scatter");
  if (c.rank() != root) return;
  MESHTRAIN_CHECK(static_cast<int>(inputs.size()) == c.size(), where(c, "scatter"),
                  ": root needs one input per rank (", c.size(), "), got ", inputs.size());
  for (const auto& t : inputs) {
    check_tensor(c, t, "scatter", "input");
    MESHTRAIN_CHECK(t.scalar_type() == output.scalar_type(), where(c, "scatter"), ": input dtype ", t.scalar_type(),
                    " differs from output dtype ", output.scalar_type());
  }
}

void check_all_to_all(const Communicator& c, const std::vector<at::Tensor>& inputs) {
  MESHTRAIN_CHECK(static_cast<int>(inputs.size()) == c.size(), where(c, "all_to_all"),
                  ": needs one input per rank (", c.size(), "), got ", inputs.size());
  for (const auto& t : inputs) {
    check_tensor(c, t, "all_to_all", "input");
    MESHTRAIN_CHECK(t.scalar_type() == inputs[0].scalar_type(), where(c, "all_to_all"),
                    ": all inputs must share one dtype; got ", inputs[0].scalar_type(), " and ", t.scalar_type());
  }
}

}  // namespace comm
}  // namespace meshtrain
