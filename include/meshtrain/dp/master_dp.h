#pragma once
// meshtrain::dp::MasterDataParallel: the article's master-based DP.
//
// One step, for a batch that rank 0 reads:
//   1. rank 0 replicates its (updated) parameters to every rank  (broadcast)
//   2. rank 0 splits the batch and sends each rank its minibatch  (scatter)
//   3. every rank runs forward on its minibatch; the outputs y_r go to rank 0 (gather)
//   4. rank 0 computes the loss over the whole batch, L(cat(y), targets), and
//      sends each rank dL/dy_r                                     (scatter)
//   5. every rank runs backward from dL/dy_r; the parameter gradients go to
//      rank 0 and are combined there                               (reduce)
//   6. rank 0 steps the optimizer (only rank 0 needs one).
// Because L is the whole-batch loss, dL/dy already carries its 1/B, so the
// combined gradient is the sum of the ranks' contributions: exactly the
// single-process gradient. (The article says "averaged": per-sample gradients
// are averaged — by the loss, once.) Minibatch sizes need not be equal.
//
// Compared with DDP: six exchanges per step instead of one (steps 1-5, plus a
// small broadcast of the batch's dtype and shape before step 2), and rank 0 does
// all the talking and the loss (DDP averages per-minibatch gradients, which
// differs when the batch loss is not a sum of per-sample terms).

#include <torch/nn/module.h>

#include <functional>
#include <memory>

#include "meshtrain/comm/communicator.h"

namespace meshtrain {
namespace dp {

class MasterDataParallel {
 public:
  using LossFn = std::function<at::Tensor(const at::Tensor& output, const at::Tensor& targets)>;
  using ForwardFn = std::function<at::Tensor(const at::Tensor& input)>;

  MasterDataParallel(std::shared_ptr<torch::nn::Module> module, comm::CommPtr comm, LossFn loss);

  // Runs steps 1-5. `inputs` and `targets` (the whole batch, split along dim 0)
  // are read on rank 0 only. Afterwards rank 0's parameters hold the batch
  // gradient in .grad (added to what is there, so several calls accumulate).
  // Returns the whole-batch loss on rank 0 (an undefined tensor elsewhere).
  at::Tensor step(const at::Tensor& inputs, const at::Tensor& targets, const ForwardFn& forward);

  const std::shared_ptr<torch::nn::Module>& module() const { return module_; }

 private:
  at::Tensor scatter_batch(const at::Tensor& batch_on_root, std::vector<int64_t>* sizes);

  std::shared_ptr<torch::nn::Module> module_;
  comm::CommPtr comm_;
  LossFn loss_;
  std::vector<at::Tensor> params_;
};

}  // namespace dp
}  // namespace meshtrain
