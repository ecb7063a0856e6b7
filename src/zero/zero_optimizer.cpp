// ZeRO stages 1 and 2 (see zero.h). Parameters live in one flat buffer (the
// module's tensors become views into it) so that reduce-scatter and all-gather
// work on whole buckets in place.

#include <ATen/ATen.h>

#include "dp/gradient_sync.h"
#include "meshtrain/util.h"
#include "meshtrain/zero.h"
#include "zero/optimizer_state.h"
#include "pieces.h"
#include "util/autograd_hooks.h"
#include "util/intercept.h"

namespace meshtrain {
namespace zero {

class ShardedCore : public std::enable_shared_from_this<ShardedCore> {
 public:
  ShardedCore(std::shared_ptr<torch::nn::Module> module, std::unique_ptr<torch::optim::Optimizer> optimizer,
              comm::CommPtr comm, ZeroOptions options);
  void install_hooks();
  void zero_grad();
  void step();
  void set_sync(bool on) { sync_ = on; }
  FullState consolidated_state(int root);
  void load_state(const FullState& state);
  std::vector<OwnedPiece> owned() { return owned_pieces(pieces_, *optimizer_, params_); }
  std::vector<std::pair<std::string, at::Tensor>> shard_gradients() const { return pieces_.gradients(params_); }
  HeldBytes held_bytes() const;
  torch::optim::Optimizer& optimizer() { return *optimizer_; }

 private:
  void on_grad_ready(size_t param);
  void launch_full_buckets_in_order();
  void finalize();
  at::Tensor bucket_grads(size_t b);

  std::shared_ptr<torch::nn::Module> module_;
  std::vector<dp::NamedParam> params_;
  comm::CommPtr comm_;
  ZeroOptions options_;
  std::unique_ptr<torch::optim::Optimizer> optimizer_;
  Layout layout_;
  std::vector<size_t> bucket_of_param_;
  std::vector<int64_t> offset_of_param_;
  at::Tensor flat_params_;  // full; the module's parameters are views into it
  at::Tensor flat_grads_;   // stage 1: full; the parameters' .grad are views into it
  at::Tensor shard_grads_;  // stage 2: this rank's shard only
  Pieces pieces_;
  // Mixed precision: pieces_.values are float32 masters, pieces_.low_grads
  // their gradients in the module's dtype (views into flat_grads_ / shard_grads_).
  at::ScalarType dtype_ = at::kFloat;
  bool mixed_ = false;
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators_;
  // One backward's bookkeeping.
  std::vector<bool> ready_;
  std::vector<size_t> pending_;
  std::vector<at::Tensor> staging_;  // stage 2: a bucket's full gradients until reduced
  std::vector<at::Tensor> reduced_;  // stage 2: a bucket's reduced shard
  std::vector<comm::WorkPtr> works_;
  size_t next_launch_ = 0;
  bool sync_ = true;
  bool in_backward_ = false;
};

ShardedCore::ShardedCore(std::shared_ptr<torch::nn::Module> module, std::unique_ptr<torch::optim::Optimizer> optimizer,
                         comm::CommPtr comm, ZeroOptions options)
    : module_(std::move(module)), comm_(std::move(comm)), options_(options), optimizer_(std::move(optimizer)) {
  MESHTRAIN_CHECK(options_.stage() == 1 || options_.stage() == 2, "ZeroRedundancyOptimizer: stage ", options_.stage(),
                  " must be 1 or 2 (stage 3 is zero::fully_shard)");
  MESHTRAIN_CHECK(optimizer_ && module_ && comm_, "ZeroRedundancyOptimizer needs a module, an optimizer and a communicator");
  dtype_ = options_.param_dtype().value_or(at::kFloat);
  mixed_ = dtype_ != at::kFloat;
  check_elementwise(*optimizer_);
  params_ = dp::unique_parameters(*module_);
  dp::verify_same_parameters(*comm_, params_, "ZeroRedundancyOptimizer");
  for (const auto& p : params_) {
    MESHTRAIN_CHECK(p.tensor.scalar_type() == at::kFloat, "ZeroRedundancyOptimizer: parameter '", p.name,
                    "' is ", p.tensor.scalar_type(), "; ZeRO shards float32 parameters");
  }
  // Flat order: reverse registration, the usual order gradients become ready.
  std::vector<size_t> order;
  std::vector<int64_t> numels;
  for (size_t i = params_.size(); i-- > 0;) order.push_back(i);
  for (const auto& p : params_) numels.push_back(p.tensor.numel());
  const int64_t cap = std::max<int64_t>(1, static_cast<int64_t>(options_.bucket_cap_mb() * (1 << 20) / 4));
  layout_ = make_layout(order, numels, cap, comm_->size());
  bucket_of_param_.assign(params_.size(), 0);
  offset_of_param_.assign(params_.size(), 0);
  for (size_t b = 0; b < layout_.buckets.size(); ++b) {
    for (const auto& e : layout_.entries) {
      if (e.offset >= layout_.buckets[b].begin && e.offset < layout_.buckets[b].end) bucket_of_param_[e.param] = b;
    }
  }
  // The module's parameters become views into one flat buffer, equal on all
  // ranks (rank 0's float32 values; under mixed precision their masters too).
  at::Tensor flat32 = at::empty({layout_.total}, at::kFloat);
  for (const auto& e : layout_.entries) {
    offset_of_param_[e.param] = e.offset;
    flat32.narrow(0, e.offset, e.numel).copy_(params_[e.param].tensor.detach().reshape({-1}));
  }
  comm_->broadcast(flat32, 0);
  flat_params_ = mixed_ ? flat32.to(dtype_) : flat32;
  {
    at::NoGradGuard no_grad;
    for (const auto& e : layout_.entries) {
      at::Tensor& p = params_[e.param].tensor;
      // A tp::parallelize'd parameter keeps its roles on its view of the flat buffer.
      intercept::set_data_keeping_marks(p, flat_params_.narrow(0, e.offset, e.numel).view(p.sizes()));
    }
  }
  if (options_.stage() == 1) {
    flat_grads_ = at::zeros({layout_.total}, dtype_);
    for (size_t i = 0; i < params_.size(); ++i) {
      params_[i].tensor.mutable_grad() =
          flat_grads_.narrow(0, offset_of_param_[i], params_[i].tensor.numel()).view(params_[i].tensor.sizes());
    }
  } else {
    shard_grads_ = at::zeros({layout_.shard_numel(comm_->rank())}, dtype_);
  }
  pieces_.pieces = layout_.pieces(comm_->rank());
  auto grad_of = [this](const ShardPiece& piece) {
    return options_.stage() == 1 ? flat_grads_.narrow(0, piece.flat_offset, piece.numel)
                                 : shard_grads_.narrow(0, piece.shard_offset, piece.numel);
  };
  for (const auto& piece : pieces_.pieces) {
    pieces_.values.push_back(mixed_ ? flat32.narrow(0, piece.flat_offset, piece.numel).clone()
                                    : flat_params_.narrow(0, piece.flat_offset, piece.numel));
    if (mixed_) pieces_.low_grads.push_back(grad_of(piece));
  }
  // Mixed: the masters get float32 gradients for the optimizer step only (step()).
  pieces_.attach(*optimizer_, params_, [&](const ShardPiece& piece) { return mixed_ ? at::Tensor() : grad_of(piece); });
  ready_.assign(params_.size(), false);
  pending_.assign(layout_.buckets.size(), 0);
  for (size_t b : bucket_of_param_) ++pending_[b];
  staging_.assign(layout_.buckets.size(), at::Tensor());
  reduced_.assign(layout_.buckets.size(), at::Tensor());
  works_.assign(layout_.buckets.size(), nullptr);
}

void ShardedCore::install_hooks() {
  std::vector<at::Tensor> tensors;
  for (const auto& p : params_) tensors.push_back(p.tensor);
  ShardedCore* self = this;
  accumulators_ = hooks::on_grad_ready(tensors, weak_from_this(), [self](size_t i) { self->on_grad_ready(i); });
}

at::Tensor ShardedCore::bucket_grads(size_t b) {
  const Bucket& bucket = layout_.buckets[b];
  if (options_.stage() == 1) return flat_grads_.narrow(0, bucket.begin, bucket.numel());
  if (!staging_[b].defined()) staging_[b] = at::zeros({bucket.numel()}, dtype_);
  return staging_[b];
}

void ShardedCore::on_grad_ready(size_t i) {
  if (!sync_) return;
  if (!in_backward_) {
    in_backward_ = true;
    ShardedCore* self = this;
    hooks::at_end_of_backward(weak_from_this(), [self] { self->finalize(); });
  }
  if (ready_[i]) return;
  ready_[i] = true;
  at::Tensor& p = params_[i].tensor;
  const size_t b = bucket_of_param_[i];
  if (options_.stage() == 2) {
    // Stage 2 keeps no full gradient: copy it into the bucket and let it go.
    if (p.grad().defined()) {
      bucket_grads(b).narrow(0, offset_of_param_[i] - layout_.buckets[b].begin, p.numel()).copy_(p.grad().reshape({-1}));
      p.mutable_grad().reset();
    }
  }
  if (--pending_[b] == 0 && options_.overlap()) launch_full_buckets_in_order();
}

void ShardedCore::launch_full_buckets_in_order() {
  const int r = comm_->rank();
  while (next_launch_ < layout_.buckets.size() && pending_[next_launch_] == 0) {
    const size_t b = next_launch_++;
    const Bucket& bucket = layout_.buckets[b];
    at::Tensor input = bucket_grads(b);
    // Stage 1 reduces in place (the shard's own region of the full gradient);
    // stage 2 into a temporary that is added to the persistent shard.
    at::Tensor output = options_.stage() == 1 ? flat_grads_.narrow(0, bucket.shard(r).offset, bucket.shard(r).size)
                                              : (reduced_[b] = at::empty({bucket.shard(r).size}, dtype_));
    works_[b] = comm_->reduce_scatter_async(input, comm::ReduceOp::kAvg, output, bucket.shard_sizes);
  }
}

void ShardedCore::finalize() {
  // Parameters that got no gradient contribute zeros.
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!ready_[i]) {
      ready_[i] = true;
      if (options_.stage() == 2) bucket_grads(bucket_of_param_[i]);
      --pending_[bucket_of_param_[i]];
    }
  }
  launch_full_buckets_in_order();
  const int r = comm_->rank();
  for (size_t b = 0; b < layout_.buckets.size(); ++b) {
    works_[b]->wait();
    works_[b].reset();
    if (options_.stage() == 2) {
      shard_grads_.narrow(0, layout_.shard_offset(r, b), layout_.buckets[b].shard(r).size).add_(reduced_[b]);
      staging_[b] = at::Tensor();
      reduced_[b] = at::Tensor();
    }
  }
  std::fill(ready_.begin(), ready_.end(), false);
  std::fill(pending_.begin(), pending_.end(), 0);
  for (size_t b : bucket_of_param_) ++pending_[b];
  next_launch_ = 0;
  in_backward_ = false;
}

void ShardedCore::zero_grad() {
  if (options_.stage() == 1) {
    flat_grads_.zero_();
  } else {
    shard_grads_.zero_();
    for (auto& p : params_) p.tensor.mutable_grad().reset();
  }
}

void ShardedCore::step() {
  MESHTRAIN_CHECK(!in_backward_, "ZeroRedundancyOptimizer::step() called during backward");
  if (mixed_) pieces_.masters_take_gradients();
  optimizer_->step();  // this rank's pieces: views into flat_params_ (mixed: float32 masters)
  if (mixed_) pieces_.masters_into(flat_params_);
  // Everyone gets everyone's updated shards, bucket by bucket.
  const int r = comm_->rank();
  std::vector<comm::WorkPtr> gathers;
  for (const auto& bucket : layout_.buckets) {
    const Range own = bucket.shard(r);
    gathers.push_back(comm_->all_gather_async(flat_params_.narrow(0, own.offset, own.size),
                                              flat_params_.narrow(0, bucket.begin, bucket.numel())));
  }
  for (auto& w : gathers) w->wait();
}

FullState ShardedCore::consolidated_state(int root) {
  FullState s;
  if (mixed_) {  // the float32 masters, from every rank's shard
    std::vector<at::Tensor> full =
        gather_full(*comm_, layout_, pieces_.masters_shard(layout_.shard_numel(comm_->rank())), params_, root);
    for (size_t i = 0; i < full.size(); ++i) s.parameters[params_[i].name] = full[i];
  } else if (comm_->rank() == root) {
    for (const auto& p : params_) s.parameters[p.name] = p.tensor.detach().clone();
  }
  s.optimizer = consolidate_optimizer(*comm_, layout_, pieces_, *optimizer_, params_, root);
  return s;
}

void ShardedCore::load_state(const FullState& state) {
  at::NoGradGuard no_grad;
  for (auto& p : params_) {
    auto it = state.parameters.find(p.name);
    MESHTRAIN_CHECK(it != state.parameters.end(), "loading ZeRO state: parameter '", p.name, "' is missing");
    p.tensor.copy_(it->second.view_as(p.tensor));
  }
  load_pieces(state, pieces_, *optimizer_, params_);
}

HeldBytes ShardedCore::held_bytes() const {
  HeldBytes h;
  h.parameters = flat_params_.nbytes();
  h.gradients = options_.stage() == 1 ? flat_grads_.nbytes() : shard_grads_.nbytes();
  h.optimizer = const_cast<Pieces&>(pieces_).optimizer_bytes(*optimizer_);
  if (mixed_) h.optimizer += pieces_.master_bytes();
  return h;
}

ZeroRedundancyOptimizer::ZeroRedundancyOptimizer(std::shared_ptr<torch::nn::Module> module,
                                                 std::unique_ptr<torch::optim::Optimizer> optimizer, comm::CommPtr comm,
                                                 ZeroOptions options)
    : module_(module.get()),
      core_(std::make_shared<ShardedCore>(std::move(module), std::move(optimizer), std::move(comm), options)) {
  core_->install_hooks();
  ShardedCore* core = core_.get();
  dp::register_gradient_sync(module_, core_, [core](bool on) { core->set_sync(on); });
}
ZeroRedundancyOptimizer::~ZeroRedundancyOptimizer() { dp::unregister_gradient_sync(module_); }
void ZeroRedundancyOptimizer::zero_grad() { core_->zero_grad(); }
void ZeroRedundancyOptimizer::step() { core_->step(); }
FullState ZeroRedundancyOptimizer::consolidated_state(int root) { return core_->consolidated_state(root); }
void ZeroRedundancyOptimizer::load_state(const FullState& state) { core_->load_state(state); }
HeldBytes ZeroRedundancyOptimizer::held_bytes() const { return core_->held_bytes(); }
std::vector<OwnedPiece> ZeroRedundancyOptimizer::owned_pieces() { return core_->owned(); }
std::vector<std::pair<std::string, at::Tensor>> ZeroRedundancyOptimizer::shard_gradients() {
  return core_->shard_gradients();
}
torch::optim::Optimizer& ZeroRedundancyOptimizer::optimizer() { return core_->optimizer(); }

ZeroRedundancyOptimizer::NoSync::NoSync(ShardedCore* core) : core_(core) { core_->set_sync(false); }
ZeroRedundancyOptimizer::NoSync::~NoSync() {
  if (core_) core_->set_sync(true);
}
ZeroRedundancyOptimizer::NoSync::NoSync(NoSync&& o) noexcept : core_(o.core_) { o.core_ = nullptr; }
ZeroRedundancyOptimizer::NoSync ZeroRedundancyOptimizer::no_sync() { return NoSync(core_.get()); }

}  // namespace zero
}  // namespace meshtrain
