#include "reducer.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <set>

#include "dp/buckets.h"
#include "meshtrain/util.h"
#include "util/autograd_hooks.h"

namespace meshtrain {
namespace dp {

// Note [Gradients as bucket views]
// After the all-reduce, a parameter's gradient becomes an alias of its slot in
// the bucket (PyTorch DDP's gradient_as_bucket_view; a tensor on the bucket's
// storage, not an autograd view, so that an optimizer's zero_grad() may detach
// it in place as it does every gradient), where before the
// average was copied back into the gradient: one copy of every gradient per
// step fewer, and the next backward, where the gradient is still defined
// (zeroed in place, or accumulated under no_sync), accumulates straight into
// the slot, which makes the copy into the bucket a no-op as well. Two copies
// of 16.8 MB per step and rank were ~10% of a 2-rank DDP step of the 4 x 1024
// MLP here (perf). Where the dtypes differ (gradients reduced in float32) or
// the parameter is not contiguous, the average is copied as before.

Reducer::Reducer(std::vector<NamedParam> params, comm::CommPtr comm, DistributedDataParallelOptions options)
    : params_(std::move(params)), comm_(std::move(comm)), options_(options) {
  MESHTRAIN_CHECK(options_.bucket_cap_mb() > 0 && options_.first_bucket_cap_mb() > 0,
                  "DistributedDataParallel: bucket caps must be positive (bucket_cap_mb ", options_.bucket_cap_mb(),
                  ", first_bucket_cap_mb ", options_.first_bucket_cap_mb(), ")");
  std::vector<size_t> reverse;
  for (size_t i = params_.size(); i-- > 0;) reverse.push_back(i);
  build_buckets(reverse);  // until the first backward shows the real order
  ready_.assign(params_.size(), false);
  used_.assign(params_.size(), 0);
}

void Reducer::install_hooks() {
  std::vector<at::Tensor> tensors;
  for (const auto& p : params_) tensors.push_back(p.tensor);
  Reducer* self = this;
  accumulators_ = hooks::on_grad_ready(tensors, weak_from_this(), [self](size_t i) { self->on_grad_ready(i); });
}

void Reducer::build_buckets(const std::vector<size_t>& order) {
  std::vector<BucketParam> sizes;
  for (const auto& p : params_) sizes.push_back({static_cast<int64_t>(p.tensor.nbytes()), static_cast<int>(p.tensor.scalar_type())});
  // A cap below one parameter's size means one bucket per parameter; the
  // first bucket is never larger than the others.
  const int64_t cap = std::max<int64_t>(1, static_cast<int64_t>(options_.bucket_cap_mb() * (1 << 20)));
  const int64_t first = std::min(cap, std::max<int64_t>(1, static_cast<int64_t>(options_.first_bucket_cap_mb() * (1 << 20))));
  const auto assignment = assign_buckets(sizes, order, first, cap);
  buckets_.clear();
  bucket_of_.assign(params_.size(), 0);
  slot_of_.assign(params_.size(), 0);
  for (const auto& members : assignment) {
    Bucket b;
    int64_t numel = 0;
    for (size_t idx : members) {
      b.params.push_back(idx);
      b.offsets.push_back(numel);
      bucket_of_[idx] = buckets_.size();
      slot_of_[idx] = b.params.size() - 1;
      numel += params_[idx].tensor.numel();
    }
    const at::Tensor& first = params_[members.front()].tensor;
    b.flat = at::zeros({numel}, first.options().dtype(options_.reduce_dtype().value_or(first.scalar_type()))
                                    .requires_grad(false));
    b.pending = members.size();
    buckets_.push_back(std::move(b));
  }
}

void Reducer::on_grad_ready(size_t index) {
  if (!sync_) {
    // See Note [Usage across no_sync]: the accumulated .grad counts as used.
    used_[index] = 1;
    return;
  }
  if (!callback_queued_) {
    Reducer* self = this;
    hooks::at_end_of_backward(weak_from_this(), [self] { self->finalize(); });
    callback_queued_ = true;
  }
  mark_ready(index, /*used=*/true);
}

void Reducer::mark_ready(size_t index, bool used) {
  if (ready_[index]) return;
  ready_[index] = true;
  if (used) used_[index] = 1;
  ready_order_.push_back(index);
  Bucket& b = buckets_[bucket_of_[index]];
  const at::Tensor& p = params_[index].tensor;
  at::Tensor slot = b.flat.narrow(0, b.offsets[slot_of_[index]], p.numel());
  // Note [Usage across no_sync]: a parameter unused in the synchronizing
  // backward may still hold gradient accumulated under no_sync. That gradient
  // is this rank's contribution (copied, not zeroed), and the parameter counts
  // as used, so that the average is written back instead of each rank keeping
  // its own. used_ is reset only after a synchronizing backward, as PyTorch's
  // local_used_map_ is.
  if (p.grad().defined()) {
    // Note [Gradients as bucket views]: a gradient that is already its slot
    // (accumulated into by this backward) needs no copy.
    if (p.grad().data_ptr() != slot.data_ptr()) slot.copy_(p.grad().reshape({-1}));
  } else {
    slot.zero_();
  }
  if (--b.pending == 0 && options_.overlap()) launch_full_buckets_in_order();
}

void Reducer::launch_full_buckets_in_order() {
  // Every rank launches buckets in index order, whatever order they fill in.
  while (next_launch_ < buckets_.size() && buckets_[next_launch_].pending == 0) {
    Bucket& b = buckets_[next_launch_++];
    b.work = comm_->all_reduce_async(b.flat, comm::ReduceOp::kAvg);
  }
}

void Reducer::mark_unused_from_graph(const std::vector<at::Tensor>& outputs) {
  if (!options_.find_unused_parameters() || !sync_) return;
  // Outputs without a graph (a forward under NoGradGuard or InferenceMode: an
  // evaluation) have no backward to come: marking every parameter unused
  // would start reductions no other rank's backward matches.
  if (std::none_of(outputs.begin(), outputs.end(), [](const at::Tensor& o) { return o.defined() && o.grad_fn(); }))
    return;
  // Walk the graph from the outputs; a parameter whose AccumulateGrad node is
  // not reached gets no gradient this iteration.
  std::set<torch::autograd::Node*> seen;
  std::vector<torch::autograd::Node*> stack;
  for (const auto& o : outputs)
    if (o.defined() && o.grad_fn()) stack.push_back(o.grad_fn().get());
  while (!stack.empty()) {
    torch::autograd::Node* n = stack.back();
    stack.pop_back();
    if (!seen.insert(n).second) continue;
    for (const auto& edge : n->next_edges())
      if (edge.function) stack.push_back(edge.function.get());
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!seen.count(accumulators_[i].get())) mark_ready(i, /*used=*/false);
  }
}

void Reducer::finalize() {
  callback_queued_ = false;
  std::vector<std::string> missing;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (ready_[i]) continue;
    if (options_.find_unused_parameters()) {
      mark_ready(i, /*used=*/false);
    } else {
      missing.push_back(params_[i].name);
    }
  }
  if (!missing.empty()) {
    std::string names;
    for (const auto& m : missing) names += (names.empty() ? "" : ", ") + m;
    reset_iteration();
    throw ConfigError(str_cat("DistributedDataParallel: parameters received no gradient in this backward: [", names,
                              "]. If the model leaves some parameters unused in some iterations, construct it with "
                              "DistributedDataParallelOptions().find_unused_parameters(true)"));
  }
  launch_full_buckets_in_order();
  at::Tensor globally_used;
  if (options_.find_unused_parameters()) {
    // A parameter unused on every rank keeps an undefined gradient, as in one process.
    globally_used = at::from_blob(used_.data(), {static_cast<int64_t>(used_.size())}, at::kByte).clone();
    comm_->all_reduce(globally_used, comm::ReduceOp::kMax);
  }
  for (auto& b : buckets_) b.work->wait();
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (globally_used.defined() && globally_used[i].item<uint8_t>() == 0) continue;
    const Bucket& b = buckets_[bucket_of_[i]];
    at::Tensor& p = params_[i].tensor;
    at::Tensor avg = b.flat.narrow(0, b.offsets[slot_of_[i]], p.numel()).view_as(p);
    if (p.grad().defined() && p.grad().data_ptr() == avg.data_ptr()) continue;  // already its slot
    if (avg.scalar_type() == p.scalar_type() && p.is_contiguous()) {
      // Note [Gradients as bucket views]: an alias of the slot, not an autograd
      // view (the optimizers' zero_grad() detaches gradients in place, which a view refuses)
      p.mutable_grad() = at::empty({0}, avg.options()).set_(avg.storage(), avg.storage_offset(), p.sizes(), p.strides());
    } else if (p.grad().defined()) {
      p.mutable_grad().copy_(avg);
    } else {
      p.mutable_grad() = avg.to(p.scalar_type(), /*non_blocking=*/false, /*copy=*/true);
    }
  }
  if (!rebuilt_ && options_.rebuild_buckets()) {
    // Rank 0's observed order becomes everyone's bucket order (same on all ranks).
    at::Tensor order = at::empty({static_cast<int64_t>(ready_order_.size())}, at::kLong);
    for (size_t i = 0; i < ready_order_.size(); ++i) order[i] = static_cast<int64_t>(ready_order_[i]);
    comm_->broadcast(order, 0);
    std::vector<size_t> observed;
    for (int64_t i = 0; i < order.numel(); ++i) observed.push_back(static_cast<size_t>(order[i].item<int64_t>()));
    build_buckets(observed);
    rebuilt_ = true;
  }
  reset_iteration();
  if (after_sync_) after_sync_();
}

void Reducer::reset_iteration() {
  std::fill(ready_.begin(), ready_.end(), false);
  std::fill(used_.begin(), used_.end(), 0);
  ready_order_.clear();
  next_launch_ = 0;
  for (auto& b : buckets_) {
    b.pending = b.params.size();
    b.work.reset();
  }
}

std::vector<std::vector<std::string>> Reducer::bucket_names() const {
  std::vector<std::vector<std::string>> out;
  for (const auto& b : buckets_) {
    out.emplace_back();
    for (size_t idx : b.params) out.back().push_back(params_[idx].name);
  }
  return out;
}

}  // namespace dp
}  // namespace meshtrain
