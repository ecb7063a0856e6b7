#pragma once
// The engine of DistributedDataParallel (see ddp.h). Internal.

#include <torch/csrc/autograd/function.h>

#include <functional>
#include <memory>
#include <mutex>
#include <vector>

#include "meshtrain/comm.h"
#include "meshtrain/dp.h"

namespace meshtrain {
namespace dp {

class Reducer : public std::enable_shared_from_this<Reducer> {
 public:
  Reducer(std::vector<NamedParam> params, comm::CommPtr comm, DistributedDataParallelOptions options);
  // Hooks hold weak references, so this is called once the Reducer is owned by a shared_ptr.
  void install_hooks();

  void on_grad_ready(size_t index);
  void finalize();
  void mark_unused_from_graph(const std::vector<at::Tensor>& outputs);
  void set_sync(bool enabled) { sync_ = enabled; }
  // Runs at the end of every synchronizing backward, after the gradients are written.
  void set_after_sync(std::function<void()> fn) { after_sync_ = std::move(fn); }
  bool sync() const { return sync_; }
  std::vector<std::vector<std::string>> bucket_names() const;

 private:
  struct Bucket {
    std::vector<size_t> params;
    std::vector<int64_t> offsets;
    at::Tensor flat;
    size_t pending = 0;
    comm::WorkPtr work;
  };
  void build_buckets(const std::vector<size_t>& order);
  void mark_ready(size_t index, bool used);
  void launch_full_buckets_in_order();
  void reset_iteration();

  std::vector<NamedParam> params_;
  comm::CommPtr comm_;
  DistributedDataParallelOptions options_;
  // AccumulateGrad nodes hold our hooks; keeping them alive keeps the hooks.
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators_;
  std::vector<Bucket> buckets_;
  std::vector<size_t> bucket_of_;
  std::vector<size_t> slot_of_;
  std::vector<bool> ready_;
  std::vector<uint8_t> used_;  // locally, since the last synchronizing backward
  std::vector<size_t> ready_order_;
  size_t next_launch_ = 0;
  bool sync_ = true;
  bool callback_queued_ = false;
  bool rebuilt_ = false;
  std::function<void()> after_sync_;
};

}  // namespace dp
}  // namespace meshtrain
