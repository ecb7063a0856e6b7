// ZeRO stage 3 (see zero.h). Each unit's full parameters live in one flat
// tensor whose storage is allocated and all-gathered only around the unit's
// forward and backward; the module's parameters are views into it.
//
// Note [Freeing gathered parameters]
// Autograd saves views of a unit's parameters for backward. We therefore free
// and refill the *storage* (StorageImpl::reset / set_data_ptr), never swap
// tensors: saved views keep pointing at the same storage and see the values
// again once the unit is regathered, which RegatherBeforeBackward ensures
// before any of the unit's backward runs. Gathers write through an alias
// tensor with its own version counter, so refilling does not look like an
// in-place modification to autograd's saved-variable checks.

#include <ATen/ATen.h>
#include <torch/csrc/autograd/function.h>

#include "meshtrain/util/error.h"
#include "meshtrain/zero/zero.h"
#include "meshtrain/zero/optimizer_state.h"
#include "pieces.h"
#include "util/autograd_hooks.h"

namespace meshtrain {
namespace zero {

namespace {

void free_storage(const at::Tensor& t) { t.storage().unsafeGetStorageImpl()->reset(); }

void allocate_storage(const at::Tensor& t, size_t nbytes) {
  c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  if (s->nbytes() == nbytes && s->data()) return;
  s->set_data_ptr_noswap(s->allocator()->allocate(nbytes));
  s->set_nbytes(nbytes);
}

}  // namespace

class FsdpCore : public std::enable_shared_from_this<FsdpCore> {
 public:
  FsdpCore(std::shared_ptr<torch::nn::Module> module, std::vector<std::shared_ptr<torch::nn::Module>> units,
           std::unique_ptr<torch::optim::Optimizer> optimizer, comm::CommPtr comm, FsdpOptions options);
  void install_hooks();
  at::Tensor run_unit(size_t u, const std::function<at::Tensor()>& fn);
  at::Tensor forward_all(const std::function<at::Tensor()>& fn);
  void before_backward(int64_t unit);  // -1: every unit
  void close() { closed_ = true; }
  size_t num_units() const { return units_.size(); }
  void zero_grad() { shard_grads_.zero_(); }
  void step();
  FullState consolidated_state(int root);
  void load_state(const FullState& state);
  std::vector<OwnedPiece> owned() { return owned_pieces(pieces_, *optimizer_, params_); }
  std::vector<std::pair<std::string, at::Tensor>> shard_gradients() const { return pieces_.gradients(params_); }
  HeldBytes held_bytes() const;
  torch::optim::Optimizer& optimizer() { return *optimizer_; }

 private:
  struct Unit {
    std::vector<size_t> params;
    int bucket = -1;   // -1: a unit without parameters
    at::Tensor full;   // flat values; storage allocated only while gathered
    at::Tensor alias;  // same storage, own version counter (see the Note)
    bool gathered = false;
    bool keep = false;
    comm::WorkPtr gathering;
    size_t pending = 0;  // parameters whose gradient has not arrived this backward
    bool reduced = false;
    at::Tensor staging, reduced_shard;
    comm::WorkPtr reducing;
  };
  // Construction, in order.
  void assign_units(const std::vector<std::shared_ptr<torch::nn::Module>>& units);
  void lay_out_units();
  at::Tensor shard_from_rank0();  // the float32 shard of rank 0's values
  void attach_optimizer(const at::Tensor& shard32);
  void launch_gather(size_t u);
  void gather(size_t u);
  void release(size_t u);
  void on_grad_ready(size_t param);
  void reduce_unit(size_t u);
  void finalize();
  void reset_backward();

  std::shared_ptr<torch::nn::Module> module_;
  std::vector<dp::NamedParam> params_;
  comm::CommPtr comm_;
  FsdpOptions options_;
  std::unique_ptr<torch::optim::Optimizer> optimizer_;
  std::vector<Unit> units_;
  std::vector<size_t> unit_of_param_;
  std::vector<int64_t> offset_in_unit_;
  Layout layout_;
  at::Tensor shard_params_, shard_grads_;  // in dtype_
  Pieces pieces_;  // mixed: float32 masters of shard_params_, low_grads in shard_grads_
  at::ScalarType dtype_ = at::kFloat;
  bool mixed_ = false;
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators_;
  std::vector<bool> ready_;
  bool in_backward_ = false;
  bool closed_ = false;  // the FullyShardedDataParallel object is gone
  int64_t gathered_bytes_ = 0, peak_gathered_bytes_ = 0;
};

// Identity in forward; in backward, regathers the unit before its own backward
// runs. The node shares ownership of the core, so a backward that outlives the
// FullyShardedDataParallel object finds it closed (a clear error), never freed.
class RegatherBeforeBackward : public torch::autograd::Node {
 public:
  RegatherBeforeBackward(std::shared_ptr<FsdpCore> core, int64_t unit) : core_(std::move(core)), unit_(unit) {}
  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    core_->before_backward(unit_);
    return {grads[0]};
  }
  std::string name() const override { return "meshtrain::RegatherBeforeBackward"; }

 private:
  std::shared_ptr<FsdpCore> core_;
  int64_t unit_;
};

at::Tensor regather_before_backward(const at::Tensor& out, std::shared_ptr<FsdpCore> core, int64_t unit) {
  auto node = std::shared_ptr<RegatherBeforeBackward>(new RegatherBeforeBackward(std::move(core), unit),
                                                      torch::autograd::deleteNode);
  node->set_next_edges(torch::autograd::collect_next_edges(out));
  at::Tensor y = out.detach();  // the same values, with this node as its history
  torch::autograd::create_gradient_edge(y, node);
  return y;
}

FsdpCore::FsdpCore(std::shared_ptr<torch::nn::Module> module, std::vector<std::shared_ptr<torch::nn::Module>> units,
                   std::unique_ptr<torch::optim::Optimizer> optimizer, comm::CommPtr comm, FsdpOptions options)
    : module_(std::move(module)), comm_(std::move(comm)), options_(options), optimizer_(std::move(optimizer)) {
  MESHTRAIN_CHECK(optimizer_ && module_ && comm_, "FullyShardedDataParallel needs a module, an optimizer and a communicator");
  dtype_ = options_.param_dtype().value_or(at::kFloat);
  mixed_ = dtype_ != at::kFloat;
  check_elementwise(*optimizer_);
  params_ = dp::unique_parameters(*module_);
  dp::verify_same_parameters(*comm_, params_, "FullyShardedDataParallel");
  for (const auto& p : params_) {
    MESHTRAIN_CHECK(p.tensor.scalar_type() == at::kFloat, "FullyShardedDataParallel: parameter '", p.name, "' is ",
                    p.tensor.scalar_type(), "; ZeRO shards float32 parameters");
  }
  assign_units(units);
  lay_out_units();
  attach_optimizer(shard_from_rank0());
  ready_.assign(params_.size(), false);
  reset_backward();
}

// Each parameter belongs to the first unit that holds it; the rest form a last unit.
void FsdpCore::assign_units(const std::vector<std::shared_ptr<torch::nn::Module>>& units) {
  unit_of_param_.assign(params_.size(), SIZE_MAX);
  auto index_of = [&](const at::Tensor& t) {
    for (size_t i = 0; i < params_.size(); ++i)
      if (params_[i].tensor.unsafeGetTensorImpl() == t.unsafeGetTensorImpl()) return i;
    return SIZE_MAX;
  };
  for (size_t u = 0; u < units.size(); ++u) {
    units_.emplace_back();
    for (const auto& t : units[u]->parameters()) {
      const size_t i = index_of(t);
      if (i != SIZE_MAX && unit_of_param_[i] == SIZE_MAX) {
        unit_of_param_[i] = u;
        units_[u].params.push_back(i);
      }
    }
  }
  Unit rest;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (unit_of_param_[i] == SIZE_MAX) {
      unit_of_param_[i] = units_.size();
      rest.params.push_back(i);
    }
  }
  if (!rest.params.empty() || units_.empty()) {
    rest.keep = true;  // used around the units, so gathered for the whole step
    units_.push_back(rest);
  }
  for (size_t u : options_.keep_gathered()) {
    MESHTRAIN_CHECK(u < units_.size(), "FsdpOptions::keep_gathered: unit ", u, " does not exist");
    units_[u].keep = true;
  }
}

// Unit after unit, one bucket each; a full buffer per unit (storage freed until gathered).
void FsdpCore::lay_out_units() {
  std::vector<size_t> order, boundaries;
  std::vector<int64_t> numels;
  for (const auto& p : params_) numels.push_back(p.tensor.numel());
  for (const auto& unit : units_) {
    boundaries.push_back(order.size());
    for (size_t i : unit.params) order.push_back(i);
  }
  layout_ = make_layout(order, numels, INT64_MAX, comm_->size(), boundaries);
  offset_in_unit_.assign(params_.size(), 0);
  int bucket = 0;
  for (auto& unit : units_) {
    if (unit.params.empty()) continue;
    unit.bucket = bucket++;
    const Bucket& b = layout_.buckets[unit.bucket];
    unit.full = at::empty({b.numel()}, dtype_);
    unit.alias = at::empty({0}, dtype_);
    unit.alias.set_(unit.full.storage(), 0, {b.numel()}, {1});
  }
}

// Rank 0's values, then each rank keeps its shard; parameters become views of
// the full buffers. The shard in float32: the masters under mixed precision.
at::Tensor FsdpCore::shard_from_rank0() {
  at::Tensor shard32 = at::empty({layout_.shard_numel(comm_->rank())}, at::kFloat);
  at::NoGradGuard no_grad;
  for (auto& unit : units_) {
    if (unit.bucket < 0) continue;
    const Bucket& b = layout_.buckets[unit.bucket];
    at::Tensor full32 = at::empty({b.numel()}, at::kFloat);
    for (const auto& e : layout_.entries) {
      if (e.offset < b.begin || e.offset >= b.end) continue;
      at::Tensor& p = params_[e.param].tensor;
      offset_in_unit_[e.param] = e.offset - b.begin;
      full32.narrow(0, e.offset - b.begin, e.numel).copy_(p.detach().reshape({-1}));
      p.set_data(unit.full.narrow(0, e.offset - b.begin, e.numel).view(p.sizes()));
    }
    comm_->broadcast(full32, 0);
    const Range own = b.shard(comm_->rank());
    shard32.narrow(0, layout_.shard_offset(comm_->rank(), unit.bucket), own.size)
        .copy_(full32.narrow(0, own.offset - b.begin, own.size));
    free_storage(unit.full);
  }
  return shard32;
}

void FsdpCore::attach_optimizer(const at::Tensor& shard32) {
  shard_params_ = mixed_ ? shard32.to(dtype_) : shard32;
  shard_grads_ = at::zeros_like(shard_params_);
  pieces_.pieces = layout_.pieces(comm_->rank());
  for (const auto& piece : pieces_.pieces) {
    pieces_.values.push_back((mixed_ ? shard32 : shard_params_).narrow(0, piece.shard_offset, piece.numel));
    if (mixed_) pieces_.low_grads.push_back(shard_grads_.narrow(0, piece.shard_offset, piece.numel));
  }
  // Mixed: the masters get float32 gradients for the optimizer step only (step()).
  pieces_.attach(*optimizer_, params_, [this](const ShardPiece& piece) {
    return mixed_ ? at::Tensor() : shard_grads_.narrow(0, piece.shard_offset, piece.numel);
  });
}

void FsdpCore::install_hooks() {
  std::vector<at::Tensor> tensors;
  for (const auto& p : params_) tensors.push_back(p.tensor);
  FsdpCore* self = this;
  accumulators_ = hooks::on_grad_ready(tensors, weak_from_this(), [self](size_t i) { self->on_grad_ready(i); });
}

void FsdpCore::launch_gather(size_t u) {
  Unit& unit = units_[u];
  if (unit.bucket < 0 || unit.gathered || unit.gathering) return;
  const Bucket& b = layout_.buckets[unit.bucket];
  allocate_storage(unit.full, b.numel() * unit.full.element_size());
  gathered_bytes_ += b.numel() * unit.full.element_size();
  peak_gathered_bytes_ = std::max(peak_gathered_bytes_, gathered_bytes_);
  const int r = comm_->rank();
  unit.gathering = comm_->all_gather_async(shard_params_.narrow(0, layout_.shard_offset(r, unit.bucket), b.shard(r).size),
                                           unit.alias);
}

void FsdpCore::gather(size_t u) {
  launch_gather(u);
  Unit& unit = units_[u];
  if (unit.gathering) {
    unit.gathering->wait();
    unit.gathering.reset();
    unit.gathered = true;
  }
}

void FsdpCore::release(size_t u) {
  Unit& unit = units_[u];
  if (unit.bucket < 0 || !unit.gathered || unit.keep) return;
  free_storage(unit.full);
  unit.gathered = false;
  gathered_bytes_ -= layout_.buckets[unit.bucket].numel() * unit.full.element_size();
}

at::Tensor FsdpCore::run_unit(size_t u, const std::function<at::Tensor()>& fn) {
  MESHTRAIN_CHECK(u < units_.size(), "FullyShardedDataParallel::run_unit: unit ", u, " of ", units_.size());
  for (size_t k = 0; k < units_.size(); ++k)
    if (units_[k].keep) launch_gather(k);
  gather(u);
  if (options_.prefetch() && u + 1 < units_.size()) launch_gather(u + 1);
  for (size_t k = 0; k < units_.size(); ++k)
    if (units_[k].keep) gather(k);
  at::Tensor out = fn();
  release(u);
  if (!at::GradMode::is_enabled() || !out.requires_grad()) return out;
  return regather_before_backward(out, shared_from_this(), static_cast<int64_t>(u));
}

at::Tensor FsdpCore::forward_all(const std::function<at::Tensor()>& fn) {
  for (size_t u = 0; u < units_.size(); ++u) launch_gather(u);
  for (size_t u = 0; u < units_.size(); ++u) gather(u);
  at::Tensor out = fn();
  for (size_t u = 0; u < units_.size(); ++u) release(u);
  if (!at::GradMode::is_enabled() || !out.requires_grad()) return out;
  return regather_before_backward(out, shared_from_this(), -1);
}

void FsdpCore::before_backward(int64_t unit) {
  MESHTRAIN_CHECK(!closed_, "FullyShardedDataParallel: backward reached unit ", unit, " after the "
                  "FullyShardedDataParallel object was destroyed; keep it alive until backward has run");
  if (unit < 0) {
    for (size_t u = 0; u < units_.size(); ++u) launch_gather(u);
    for (size_t u = 0; u < units_.size(); ++u) gather(u);
    return;
  }
  gather(static_cast<size_t>(unit));
  if (options_.prefetch() && unit > 0) launch_gather(static_cast<size_t>(unit - 1));
}

void FsdpCore::on_grad_ready(size_t i) {
  if (!in_backward_) {
    in_backward_ = true;
    FsdpCore* self = this;
    hooks::at_end_of_backward(weak_from_this(), [self] { self->finalize(); });
  }
  if (ready_[i]) return;
  ready_[i] = true;
  const size_t u = unit_of_param_[i];
  if (--units_[u].pending == 0) reduce_unit(u);
}

// All of a unit's gradients are in: reduce-scatter them, keep the shard, free the rest.
void FsdpCore::reduce_unit(size_t u) {
  Unit& unit = units_[u];
  if (unit.reduced || unit.bucket < 0) return;
  unit.reduced = true;
  const Bucket& b = layout_.buckets[unit.bucket];
  unit.staging = at::zeros({b.numel()}, dtype_);
  for (size_t i : unit.params) {
    at::Tensor& p = params_[i].tensor;
    if (p.grad().defined()) {
      unit.staging.narrow(0, offset_in_unit_[i], p.numel()).copy_(p.grad().reshape({-1}));
      p.mutable_grad().reset();
    }
  }
  unit.reduced_shard = at::empty({b.shard(comm_->rank()).size}, dtype_);
  unit.reducing = comm_->reduce_scatter_async(unit.staging, comm::ReduceOp::kAvg, unit.reduced_shard, b.shard_sizes);
  release(u);
}

void FsdpCore::finalize() {
  // Units some of whose parameters got no gradient: their zeros join the reduction now.
  for (size_t u = 0; u < units_.size(); ++u) reduce_unit(u);
  const int r = comm_->rank();
  for (auto& unit : units_) {
    if (!unit.reducing) continue;
    unit.reducing->wait();
    shard_grads_.narrow(0, layout_.shard_offset(r, unit.bucket), unit.reduced_shard.numel()).add_(unit.reduced_shard);
    unit.reducing.reset();
    unit.staging = at::Tensor();
    unit.reduced_shard = at::Tensor();
  }
  // The step is over for the kept units too.
  for (size_t u = 0; u < units_.size(); ++u) {
    const bool keep = units_[u].keep;
    units_[u].keep = false;
    release(u);
    units_[u].keep = keep;
  }
  reset_backward();
}

void FsdpCore::reset_backward() {
  std::fill(ready_.begin(), ready_.end(), false);
  for (auto& unit : units_) {
    unit.pending = unit.params.size();
    unit.reduced = false;
  }
  in_backward_ = false;
}

FullState FsdpCore::consolidated_state(int root) {
  FullState s;
  const at::Tensor shard = mixed_ ? pieces_.masters_shard(shard_params_.numel()) : shard_params_;
  std::vector<at::Tensor> full = gather_full(*comm_, layout_, shard, params_, root);
  for (size_t i = 0; i < full.size(); ++i) s.parameters[params_[i].name] = full[i];
  s.optimizer = consolidate_optimizer(*comm_, layout_, pieces_, *optimizer_, params_, root);
  return s;
}

void FsdpCore::step() {
  if (mixed_) pieces_.masters_take_gradients();
  optimizer_->step();
  if (mixed_) pieces_.masters_into(shard_params_, /*by_flat_offset=*/false);
}

void FsdpCore::load_state(const FullState& state) {
  load_pieces(state, pieces_, *optimizer_, params_);
  if (mixed_) pieces_.masters_into(shard_params_, /*by_flat_offset=*/false);
  for (size_t u = 0; u < units_.size(); ++u) {  // stale gathered values go
    const bool keep = units_[u].keep;
    units_[u].keep = false;
    release(u);
    units_[u].keep = keep;
  }
}

HeldBytes FsdpCore::held_bytes() const {
  HeldBytes h;
  h.parameters = shard_params_.nbytes();
  h.gradients = shard_grads_.nbytes();
  h.optimizer = const_cast<Pieces&>(pieces_).optimizer_bytes(*optimizer_) + (mixed_ ? pieces_.master_bytes() : 0);
  h.buffers = peak_gathered_bytes_;
  return h;
}

FullyShardedDataParallel::FullyShardedDataParallel(std::shared_ptr<torch::nn::Module> module,
                                                   std::vector<std::shared_ptr<torch::nn::Module>> units,
                                                   std::unique_ptr<torch::optim::Optimizer> optimizer,
                                                   comm::CommPtr comm, FsdpOptions options)
    : core_(std::make_shared<FsdpCore>(std::move(module), std::move(units), std::move(optimizer), std::move(comm),
                                       options)) {
  core_->install_hooks();
}
FullyShardedDataParallel::~FullyShardedDataParallel() { core_->close(); }
at::Tensor FullyShardedDataParallel::run_unit(size_t unit, const std::function<at::Tensor()>& fn) {
  return core_->run_unit(unit, fn);
}
at::Tensor FullyShardedDataParallel::forward(const std::function<at::Tensor()>& fn) { return core_->forward_all(fn); }
size_t FullyShardedDataParallel::num_units() const { return core_->num_units(); }
void FullyShardedDataParallel::zero_grad() { core_->zero_grad(); }
void FullyShardedDataParallel::step() { core_->step(); }
FullState FullyShardedDataParallel::consolidated_state(int root) { return core_->consolidated_state(root); }
void FullyShardedDataParallel::load_state(const FullState& state) { core_->load_state(state); }
HeldBytes FullyShardedDataParallel::held_bytes() const { return core_->held_bytes(); }
std::vector<OwnedPiece> FullyShardedDataParallel::owned_pieces() { return core_->owned(); }
std::vector<std::pair<std::string, at::Tensor>> FullyShardedDataParallel::shard_gradients() {
  return core_->shard_gradients();
}
torch::optim::Optimizer& FullyShardedDataParallel::optimizer() { return core_->optimizer(); }

}  // namespace zero
}  // namespace meshtrain
