#include "meshtrain/dp.h"

#include <ATen/ATen.h>

#include <numeric>

#include "meshtrain/util.h"
#include "util/shard.h"

namespace meshtrain {
namespace dp {

MasterDataParallel::MasterDataParallel(std::shared_ptr<torch::nn::Module> module, comm::CommPtr comm, LossFn loss)
    : module_(std::move(module)), comm_(std::move(comm)), loss_(std::move(loss)) {
  MESHTRAIN_CHECK(module_ && comm_ && loss_, "MasterDataParallel needs a module, a communicator and a loss");
  auto named = unique_parameters(*module_);
  verify_same_parameters(*comm_, named, "MasterDataParallel");
  for (const auto& p : named) params_.push_back(p.tensor);
}

// Rank 0 sends each rank its rows; the others learn dtype and shape first
// (one small broadcast: [dtype, ndim, dims...]).
at::Tensor MasterDataParallel::scatter_batch(const at::Tensor& batch_on_root, std::vector<int64_t>* sizes) {
  const int r = comm_->rank();
  at::Tensor meta = at::zeros({10}, at::kLong);
  if (r == 0) {
    MESHTRAIN_CHECK(batch_on_root.dim() >= 1 && batch_on_root.dim() <= 8, "MasterDataParallel: batch tensors must have 1 to 8 dims");
    meta[0] = static_cast<int64_t>(batch_on_root.scalar_type());
    meta[1] = batch_on_root.dim();
    for (int64_t d = 0; d < batch_on_root.dim(); ++d) meta[2 + d] = batch_on_root.size(d);
  }
  comm_->broadcast(meta, 0);
  std::vector<int64_t> shape(meta.data_ptr<int64_t>() + 2, meta.data_ptr<int64_t>() + 2 + meta[1].item<int64_t>());
  MESHTRAIN_CHECK(shape[0] >= comm_->size(), "MasterDataParallel: a batch of ", shape[0], " samples cannot feed ",
                  comm_->size(), " ranks");
  *sizes = shard_sizes(shape[0], comm_->size());
  shape[0] = (*sizes)[r];
  at::Tensor mine = at::empty(shape, at::TensorOptions().dtype(static_cast<at::ScalarType>(meta[0].item<int64_t>())));
  std::vector<at::Tensor> pieces;
  if (r == 0) pieces = batch_on_root.split_with_sizes(*sizes, 0);
  comm_->scatter(mine, pieces, 0);
  return mine;
}

at::Tensor MasterDataParallel::step(const at::Tensor& inputs, const at::Tensor& targets, const ForwardFn& forward) {
  const int r = comm_->rank();
  // 1. Replicate rank 0's parameters.
  broadcast_coalesced(*comm_, params_, 0);
  // 2. Scatter the minibatches (sizes may differ by one; the batch size
  // travels in the inputs' shape, so every rank derives the same split).
  std::vector<int64_t> sizes;
  at::Tensor x = scatter_batch(inputs, &sizes);
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
