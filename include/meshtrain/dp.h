#pragma once
// meshtrain/dp.h: data parallelism: DDP (no_sync, buckets), replicate(), master-based DP.
// Part of the public API (meshtrain/meshtrain.h includes it); the sections below
// are in dependency order.

#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <functional>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "meshtrain/comm.h"

// ===== params =====
// Parameter utilities shared by the data-parallel strategies (DDP, master DP,
// ZeRO): deduplicated parameter lists, a cross-rank check that every rank holds
// the same parameters, and coalesced broadcasts.

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

// ===== ddp =====
// meshtrain::dp::DistributedDataParallel: PyTorch's DDP for any torch::nn::Module.
//
//   grad = (1/n) * sum over ranks of each rank's local gradient
//
// At construction every rank's parameter list is checked against the others
// (ConfigError naming the first mismatch), then parameters and buffers are
// broadcast from rank 0. During backward, each parameter's gradient is copied
// into its bucket as soon as autograd has accumulated it; a full bucket's
// all-reduce starts at once (asynchronously, in bucket order on every rank),
// overlapping the rest of backward. At the end of backward the averaged
// gradients are written back to .grad, and buffers are broadcast from rank 0
// (broadcast_buffers). Buckets follow the order gradients became ready in the
// first iteration (reverse registration order before it).
//
// Most code wants dp::replicate (below), which wraps a module and leaves
// its forward as it is. This class is the engine, for code that keeps the
// module and the DDP object apart:
//
//   dp::DistributedDataParallel ddp(model, world);
//   auto loss = loss_fn(model->forward(x), y);
//   loss.backward();          // gradients are averaged across ranks here
//   optimizer.step();
//   { auto guard = ddp.no_sync(); ... }   // accumulate without communicating

struct DistributedDataParallelOptions {
  // Bucket size cap (torch's default: 25 MiB) and the smaller first bucket.
  TORCH_ARG(double, bucket_cap_mb) = 25.0;
  TORCH_ARG(double, first_bucket_cap_mb) = 1.0;
  // Parameters may get no gradient in an iteration (found by walking the
  // autograd graph after forward). Off: such a parameter is an error naming it.
  TORCH_ARG(bool, find_unused_parameters) = false;
  // Broadcast buffers (e.g. BatchNorm running statistics) from rank 0 at the
  // end of every synchronizing backward (PyTorch: before each forward; there
  // is no forward hook to do it in libtorch, and rank 0's buffers evolve the
  // same way), so that every replica holds rank 0's for the next forward.
  TORCH_ARG(bool, broadcast_buffers) = true;
  // Start each bucket's all-reduce during backward; off: all after backward (for measurements).
  TORCH_ARG(bool, overlap) = true;
  // After the first backward, re-bucket in the order gradients became ready
  // (PyTorch's default). Off: keep reverse registration order, so that bucket
  // boundaries, and with them the order floats are summed in, never depend on
  // when the run started (the trainer turns it off for bitwise-exact resume).
  TORCH_ARG(bool, rebuild_buckets) = true;
  // The dtype gradients are all-reduced in (default: each parameter's own).
  // at::kFloat for bf16 parameters: buckets hold float32 copies of the
  // gradients, so the sum over ranks is taken in float32 and rounded to the
  // parameter's dtype once, at the cost of twice the bytes.
  TORCH_ARG(c10::optional<at::ScalarType>, reduce_dtype) = c10::nullopt;
};

class Reducer;

class DistributedDataParallel {
 public:
  DistributedDataParallel(std::shared_ptr<torch::nn::Module> module, comm::CommPtr comm,
                          DistributedDataParallelOptions options = {});
  ~DistributedDataParallel();
  DistributedDataParallel(const DistributedDataParallel&) = delete;
  DistributedDataParallel& operator=(const DistributedDataParallel&) = delete;

  // Runs fn (the module's forward), then post_forward() on its outputs. Needed
  // only with find_unused_parameters, to reduce unused parameters' buckets
  // early and to let a rank whose backward reaches no parameter take part;
  // otherwise call the module's forward directly. Outputs without a graph (an
  // evaluation under NoGradGuard) are left alone: no backward follows them.
  template <typename Fn>
  auto forward(Fn&& fn) -> decltype(fn()) {
    auto out = fn();
    post_forward(outputs_of(out));
    return out;
  }
  // Broadcasts the buffers from rank 0 now (a collective: every rank calls
  // it), e.g. after changing them outside of training.
  void broadcast_buffers();
  // Finds unused parameters from the outputs' autograd graph (when enabled).
  void post_forward(const std::vector<at::Tensor>& outputs);

  // While the guard lives, backward only accumulates .grad locally.
  class NoSync {
   public:
    explicit NoSync(Reducer* r);
    ~NoSync();
    NoSync(NoSync&& other) noexcept;

   private:
    Reducer* reducer_;
  };
  NoSync no_sync();

  const std::shared_ptr<torch::nn::Module>& module() const { return module_; }
  comm::Communicator& comm() const { return *comm_; }
  // Parameter names per bucket, in launch order.
  std::vector<std::vector<std::string>> buckets() const;

 private:
  static std::vector<at::Tensor> outputs_of(const at::Tensor& t) { return {t}; }
  static std::vector<at::Tensor> outputs_of(const std::vector<at::Tensor>& v) { return v; }

  std::shared_ptr<torch::nn::Module> module_;
  comm::CommPtr comm_;
  DistributedDataParallelOptions options_;
  std::shared_ptr<Reducer> reducer_;
};

// ===== replicate =====
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

// ===== master dp =====
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
