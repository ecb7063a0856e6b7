#pragma once
// dp::replicate: DistributedDataParallel applied to a module the user already
// has, with the forward code left as it is (PyTorch's `DDP(model)`):
//
//   auto model = dp::replicate(std::make_shared<Net>(), mesh.dp());
//   torch::optim::SGD optimizer(model->parameters(), 0.1);
//   auto loss = loss_fn(model->forward(x), y);   // the module's own forward
//   loss.backward();                             // gradients averaged across ranks here
//   { auto guard = model.no_sync(); ... }        // accumulate without communicating
//
// Everything happens in autograd hooks (libtorch 1.13 modules have no forward
// hooks, and none are needed): see ddp.h. Two consequences of having no
// forward hook, both documented in docs/dp.md:
//  - buffers (BatchNorm's running statistics) come from rank 0 at construction
//    and after every synchronizing backward, where PyTorch broadcasts them
//    before each forward; rank 0's buffers evolve the same either way;
//  - with find_unused_parameters, unused parameters are found at the end of
//    backward (their buckets are reduced last) instead of by walking the graph
//    after forward; a rank whose backward reaches no parameter at all then
//    stops the others at their timeout. DistributedDataParallel::forward(fn)
//    walks the graph, for models that need it.

#include <memory>
#include <type_traits>

#include <torch/nn/pimpl.h>

#include "meshtrain/dp/ddp.h"

namespace meshtrain {
namespace dp {

// The user's module, replicated: use it as the module (`model->forward(x)`,
// `model->parameters()`); it also offers no_sync() and the DDP object.
template <typename M>
class Replicated {
 public:
  Replicated(std::shared_ptr<M> module, std::shared_ptr<DistributedDataParallel> ddp)
      : module_(std::move(module)), ddp_(std::move(ddp)) {}

  M* operator->() const { return module_.get(); }
  M& operator*() const { return *module_; }
  const std::shared_ptr<M>& module() const { return module_; }
  DistributedDataParallel::NoSync no_sync() const { return ddp_->no_sync(); }
  DistributedDataParallel& ddp() const { return *ddp_; }

 private:
  std::shared_ptr<M> module_;
  std::shared_ptr<DistributedDataParallel> ddp_;
};

// Broadcasts rank 0's parameters and buffers to every rank of `comm` (after
// checking that every rank has the same parameters), then averages gradients
// in every synchronizing backward.
template <typename M>
Replicated<M> replicate(std::shared_ptr<M> module, comm::CommPtr comm, DistributedDataParallelOptions options = {}) {
  static_assert(std::is_base_of<torch::nn::Module, M>::value, "dp::replicate takes a torch::nn::Module");
  auto ddp = std::make_shared<DistributedDataParallel>(module, std::move(comm), options);
  return Replicated<M>(std::move(module), std::move(ddp));
}

// The same for a module holder (torch::nn::Linear, torch::nn::Sequential, TORCH_MODULE types).
template <typename Impl>
Replicated<Impl> replicate(const torch::nn::ModuleHolder<Impl>& module, comm::CommPtr comm,
                           DistributedDataParallelOptions options = {}) {
  return replicate(module.ptr(), std::move(comm), options);
}

}  // namespace dp
}  // namespace meshtrain
