#include "meshtrain/dp/master_dp.h"

#include <ATen/ATen.h>

#include <numeric>

#include "meshtrain/dp/params.h"
#include "meshtrain/util/error.h"
#include "meshtrain/util/shard.h"

namespace meshtrain {
namespace dp {

MasterDataParallel::MasterDataParallel(std::shared_ptr<torch::nn::Module> module, comm::CommPtr comm, LossFn loss)
    : module_(std::move(module)), comm_(std::move(comm)), loss_(std::move(loss)) {
  MESHTRAIN_CHECK(module_ && comm_ && loss_, "MasterDataParallel needs a module, a communicator and a loss");
  auto named = unique_parameters(*module_);
  verify_same_parameters(*comm_, named, "MasterDataParallel");
  for (const auto& p : named) params_.push_back(p.tensor);
}

// Rank 0 sends each rank its rows; the others learn the shape first.
at::Tensor MasterDataParallel::scatter_batch(const at::Tensor& batch_on_root, const std::vector<int64_t>& sizes) {
  const int r = comm_->rank();
  at::Tensor meta = r == 0 ? at::tensor(std::vector<int64_t>(batch_on_root.sizes().begin(), batch_on_root.sizes().end()))
                           : at::Tensor();
  at::Tensor ndim = at::tensor({r == 0 ? meta.numel() : int64_t{0}});
  comm_->broadcast(ndim, 0);
  if (r != 0) meta = at::zeros({ndim.item<int64_t>()}, at::kLong);
  at::Tensor dtype = at::tensor({r == 0 ? static_cast<int64_t>(batch_on_root.scalar_type()) : int64_t{0}});
  comm_->broadcast(meta, 0);
  comm_->broadcast(dtype, 0);
  std::vector<int64_t> shape(meta.data_ptr<int64_t>(), meta.data_ptr<int64_t>() + meta.numel());
  shape[0] = sizes[r];
  at::Tensor mine = at::empty(shape, at::TensorOptions().dtype(static_cast<at::ScalarType>(dtype.item<int64_t>())));
  std::vector<at::Tensor> pieces;
  if (r == 0) {
    MESHTRAIN_CHECK(batch_on_root.size(0) == std::accumulate(sizes.begin(), sizes.end(), int64_t{0}),
                    "MasterDataParallel: batch size mismatch");
    pieces = batch_on_root.split_with_sizes(sizes, 0);
  }
  comm_->scatter(mine, pieces, 0);
  return mine;
}

at::Tensor MasterDataParallel::step(const at::Tensor& inputs, const at::Tensor& targets, const ForwardFn& forward) {
  const int r = comm_->rank(), n = comm_->size();
  // 1. Replicate rank 0's parameters.
  broadcast_coalesced(*comm_, params_, 0);
  // 2. Scatter the minibatches (sizes may differ by one).
  at::Tensor batch_size = at::tensor({r == 0 ? inputs.size(0) : int64_t{0}});
  comm_->broadcast(batch_size, 0);
  const int64_t B = batch_size.item<int64_t>();
  MESHTRAIN_CHECK(B >= n, "MasterDataParallel: a batch of ", B, " samples cannot feed ", n, " ranks");
  const std::vector<int64_t> sizes = shard_sizes(B, n);
  at::Tensor x = scatter_batch(inputs, sizes);
  // 3. Forward locally; outputs to rank 0.
  at::Tensor y = forward(x);
  std::vector<at::Tensor> outputs = comm_->gather(y.detach(), 0);
  // 4. Rank 0: whole-batch loss and its gradient with respect to every output.
  at::Tensor loss, grad_y = at::empty_like(y);
  std::vector<at::Tensor> grads;
  if (r == 0) {
    at::Tensor all = at::cat(outputs, 0).requires_grad_(true);
    loss = loss_(all, targets);
    loss.backward();
    grads = all.grad().split_with_sizes(sizes, 0);
  }
  comm_->scatter(grad_y, grads, 0);
  // 5. Backward from dL/dy; gradients summed on rank 0.
  std::vector<at::Tensor> before(params_.size());
  for (size_t i = 0; i < params_.size(); ++i) {
    if (params_[i].grad().defined()) before[i] = params_[i].grad().clone();
    if (params_[i].grad().defined()) params_[i].mutable_grad().zero_();
  }
  y.backward(grad_y);
  std::vector<at::Tensor> flat_parts;
  for (auto& p : params_) flat_parts.push_back(p.grad().defined() ? p.grad().reshape({-1}) : at::zeros({p.numel()}, p.options()));
  at::Tensor flat = at::cat(flat_parts);
  comm_->reduce(flat, 0, comm::ReduceOp::kSum);
  if (r == 0) {
    at::NoGradGuard no_grad;
    int64_t offset = 0;
    for (size_t i = 0; i < params_.size(); ++i) {
      at::Tensor g = flat.narrow(0, offset, params_[i].numel()).view_as(params_[i]);
      offset += params_[i].numel();
      if (before[i].defined()) g = g + before[i];
      if (params_[i].grad().defined()) params_[i].mutable_grad().copy_(g); else params_[i].mutable_grad() = g.clone();
    }
  }
  return loss;
}

}  // namespace dp
}  // namespace meshtrain
