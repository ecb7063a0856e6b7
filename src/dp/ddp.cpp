#include "meshtrain/dp.h"

#include "dp/gradient_sync.h"
#include "meshtrain/util.h"
#include "reducer.h"

namespace meshtrain {
namespace dp {

DistributedDataParallel::DistributedDataParallel(std::shared_ptr<torch::nn::Module> module, comm::CommPtr comm,
                                                 DistributedDataParallelOptions options)
    : module_(std::move(module)), comm_(std::move(comm)), options_(options) {
  MESHTRAIN_CHECK(module_ && comm_, "DistributedDataParallel needs a module and a communicator");
  auto params = unique_parameters(*module_);
  verify_same_parameters(*comm_, params, "DistributedDataParallel");
  std::vector<at::Tensor> state;
  for (const auto& p : params) state.push_back(p.tensor);
  for (const auto& b : unique_buffers(*module_)) state.push_back(b.tensor);
  broadcast_coalesced(*comm_, state, 0);  // every replica starts from rank 0's values
  reducer_ = std::make_shared<Reducer>(std::move(params), comm_, options_);
  if (options_.broadcast_buffers() && !unique_buffers(*module_).empty()) {
    // The reducer lives no longer than this object (it is ours alone), so `this` stays valid.
    reducer_->set_after_sync([this] { broadcast_buffers(); });
  }
  reducer_->install_hooks();
  Reducer* reducer = reducer_.get();
  register_gradient_sync(module_.get(), reducer_, [reducer](bool on) { reducer->set_sync(on); });
}

DistributedDataParallel::~DistributedDataParallel() { unregister_gradient_sync(module_.get()); }

void DistributedDataParallel::broadcast_buffers() {
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> buffers;
  for (const auto& b : unique_buffers(*module_)) buffers.push_back(b.tensor);
  if (!buffers.empty()) broadcast_coalesced(*comm_, buffers, 0);
}

void DistributedDataParallel::post_forward(const std::vector<at::Tensor>& outputs) {
  reducer_->mark_unused_from_graph(outputs);
}

DistributedDataParallel::NoSync::NoSync(Reducer* r) : reducer_(r) { reducer_->set_sync(false); }
DistributedDataParallel::NoSync::~NoSync() {
  if (reducer_) reducer_->set_sync(true);
}
DistributedDataParallel::NoSync::NoSync(NoSync&& other) noexcept : reducer_(other.reducer_) { other.reducer_ = nullptr; }

DistributedDataParallel::NoSync DistributedDataParallel::no_sync() { return NoSync(reducer_.get()); }

std::vector<std::vector<std::string>> DistributedDataParallel::buckets() const { return reducer_->bucket_names(); }

}  // namespace dp
}  // namespace meshtrain
