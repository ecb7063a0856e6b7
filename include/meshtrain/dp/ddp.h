#pragma once
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
// Most code wants dp::replicate (replicate.h), which wraps a module and leaves
// its forward as it is. This class is the engine, for code that keeps the
// module and the DDP object apart:
//
//   dp::DistributedDataParallel ddp(model, world);
//   auto loss = loss_fn(model->forward(x), y);
//   loss.backward();          // gradients are averaged across ranks here
//   optimizer.step();
//   { auto guard = ddp.no_sync(); ... }   // accumulate without communicating

#include <torch/arg.h>
#include <torch/nn/module.h>

#include <memory>

#include "meshtrain/comm/communicator.h"

namespace meshtrain {
namespace dp {

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

}  // namespace dp
}  // namespace meshtrain
