// zero::fully_shard on plain modules: see include/meshtrain/zero/fully_shard.h.
#include "meshtrain/zero/fully_shard.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <unordered_map>

#include "meshtrain/dp/gradient_sync.h"
#include "meshtrain/util/error.h"
#include "meshtrain/util/shard.h"
#include "util/autograd_hooks.h"
#include "util/intercept.h"

namespace meshtrain {
namespace zero {

namespace {

class Unit;

// The units of one communicator on this process: an operation on one unit
// frees the others, and one end-of-backward callback settles them all.
struct Group : std::enable_shared_from_this<Group> {
  std::vector<Unit*> units;  // units live as long as the registry (the process)
  bool end_queued = false;
  void queue_end_of_backward();
  void end_of_backward();
};

std::shared_ptr<Group> group_of(const comm::CommPtr& dp) {
  static std::unordered_map<const comm::Communicator*, std::shared_ptr<Group>> groups;
  auto& g = groups[dp.get()];
  if (!g) g = std::make_shared<Group>();
  return g;
}

// One fully_shard() call: the module's parameters laid end to end, this
// rank's part of that flat buffer kept as `shard`.
constexpr const char* kShardName = "_fully_sharded";

class Unit : public intercept::Role, public std::enable_shared_from_this<Unit> {
 public:
  // A name the module registered parameter `index` under (relative to the
  // module given to fully_shard; a tied weight has several).
  struct Name {
    std::string name;
    size_t index;
  };

  Unit(std::vector<at::Tensor> params, std::vector<Name> names, comm::CommPtr dp, FullyShardOptions options,
       std::shared_ptr<Group> group)
      : params_(std::move(params)), names_(std::move(names)), dp_(std::move(dp)), options_(options), group_(std::move(group)) {
    for (const at::Tensor& p : params_) {
      offsets_.push_back(total_);
      total_ += p.numel();
      if (p.requires_grad()) ++trainable_;
    }
    mine_ = shard_range(total_, dp_->size(), dp_->rank());
    ready_.assign(params_.size(), false);
  }

  // Takes rank 0's values, keeps this rank's part, frees the parameters.
  void start() {
    at::NoGradGuard no_grad;
    intercept::Bypass bypass;
    std::vector<at::Tensor> flat;
    for (const at::Tensor& p : params_) flat.push_back(p.detach().reshape({-1}));
    at::Tensor full = at::cat(flat);
    dp_->broadcast(full, 0);
    shard_ = full.narrow(0, mine_.offset, mine_.size).clone().requires_grad_(trainable_ > 0);
    std::vector<at::Tensor> trainable;
    std::vector<size_t> index;  // trainable[k] is params_[index[k]]
    for (size_t i = 0; i < params_.size(); ++i) {
      if (params_[i].requires_grad()) trainable.push_back(params_[i]), index.push_back(i);
    }
    accumulators_ = hooks::on_grad_ready(trainable, weak_from_this(), [this, index](size_t k) { grad_ready(index[k]); });
    for (size_t i = 0; i < params_.size(); ++i) intercept::mark(params_[i], shared_from_this(), static_cast<int>(i));
    gathered_ = true;
    free();
  }

  void before(const std::vector<intercept::Role*>& touched) override {
    if (gathered_ && gathered_version_ != shard_._version()) free();  // the optimizer stepped the shard
    for (Unit* other : group_->units) {
      const bool in_use = std::find(touched.begin(), touched.end(), other) != touched.end();
      if (other->gathered_ && !in_use && other->options_.reshard_after_forward()) other->free();
    }
    if (!gathered_) gather();
  }

  // An in-place operation changed parameter i: its part in this rank's shard follows.
  void written(int i) override {
    const Range param{offsets_[i], params_[i].numel()};
    const int64_t lo = std::max(param.offset, mine_.offset), hi = std::min(param.end(), mine_.end());
    if (lo < hi) {
      at::NoGradGuard no_grad;
      shard_.detach().narrow(0, lo - mine_.offset, hi - lo).copy_(params_[i].detach().reshape({-1}).narrow(0, lo - param.offset, hi - lo));
    }
    gathered_version_ = shard_._version();
  }

  // Off: gradients accumulate at full size in the parameters' .grad until a
  // backward with sync on (PyTorch's set_requires_gradient_sync).
  void set_sync(bool on) { sync_ = on; }

  void grad_ready(size_t i) {
    group_->queue_end_of_backward();
    if (!sync_) return;
    if (!ready_[i]) {
      ready_[i] = true;
      ++ready_count_;
    }
    if (ready_count_ == trainable_) reduce_gradients();
  }

  // Reduce-scatters what the parameters' .grad hold (zeros where none), adds
  // the average to the shard's .grad, frees the full gradients and the unit.
  void reduce_gradients() {
    at::NoGradGuard no_grad;
    intercept::Bypass bypass;
    at::Tensor flat = at::zeros({total_}, shard_.options().requires_grad(false));
    for (size_t i = 0; i < params_.size(); ++i) {
      at::Tensor& g = params_[i].mutable_grad();
      if (g.defined()) flat.narrow(0, offsets_[i], params_[i].numel()).copy_(g.reshape({-1}));
      g.reset();
    }
    at::Tensor mine = dp_->reduce_scatter(flat).div_(dp_->size());
    at::Tensor& grad = shard_.mutable_grad();
    if (grad.defined()) grad.add_(mine);
    else grad = mine;
    reduced_ = true;
    ready_.assign(params_.size(), false);
    ready_count_ = 0;
    free();
  }

  // At the end of backward: units whose gradients did not all arrive (unused
  // parameters) are reduced now, in the same order on every rank.
  void settle() {
    if (sync_ && trainable_ > 0 && (!reduced_ || ready_count_ > 0)) reduce_gradients();
    reduced_ = false;
    free();
  }

  void free() {
    if (!gathered_) return;
    for (const at::Tensor& p : params_) {
      c10::StorageImpl* s = p.storage().unsafeGetStorageImpl();
      s->set_data_ptr_noswap(c10::DataPtr(nullptr, s->device()));
      s->set_nbytes(0);
    }
    gathered_ = false;
  }

  void gather() {
    at::NoGradGuard no_grad;
    intercept::Bypass bypass;
    const at::Tensor full = dp_->all_gather_flat(shard_.detach());
    for (size_t i = 0; i < params_.size(); ++i) {
      const at::Tensor& p = params_[i];
      c10::StorageImpl* s = p.storage().unsafeGetStorageImpl();
      const size_t bytes = static_cast<size_t>(p.numel()) * p.element_size();
      s->set_data_ptr_noswap(c10::GetAllocator(s->device_type())->allocate(bytes));
      s->set_nbytes(bytes);
      at::from_blob(s->data(), {p.numel()}, full.options()).copy_(full.narrow(0, offsets_[i], p.numel()));
    }
    gathered_ = true;
    gathered_version_ = shard_._version();
  }

  // Every parameter at full shape (collective over dp).
  std::vector<at::Tensor> full_values() const {
    intercept::Bypass bypass;
    const at::Tensor full = dp_->all_gather_flat(shard_.detach());
    std::vector<at::Tensor> out;
    for (size_t i = 0; i < params_.size(); ++i)
      out.push_back(full.narrow(0, offsets_[i], params_[i].numel()).view(params_[i].sizes()).clone());
    return out;
  }

  const at::Tensor& shard() const { return shard_; }
  const std::vector<Name>& names() const { return names_; }
  // The shard plus whatever the parameters' storage holds now (measured, not inferred from gathered_).
  int64_t held_bytes() const {
    int64_t bytes = static_cast<int64_t>(shard_.nbytes());
    for (const at::Tensor& p : params_) bytes += static_cast<int64_t>(p.storage().nbytes());
    return bytes;
  }

 private:
  std::vector<at::Tensor> params_;
  std::vector<Name> names_;
  comm::CommPtr dp_;
  FullyShardOptions options_;
  std::shared_ptr<Group> group_;
  std::vector<int64_t> offsets_;
  int64_t total_ = 0;
  size_t trainable_ = 0;
  Range mine_;
  at::Tensor shard_;
  bool gathered_ = false;
  int64_t gathered_version_ = -1;
  std::vector<bool> ready_;
  size_t ready_count_ = 0;
  bool reduced_ = false;  // in this backward
  bool sync_ = true;
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators_;  // they hold the gradient hooks
};

void Group::queue_end_of_backward() {
  if (end_queued) return;
  end_queued = true;
  hooks::at_end_of_backward(weak_from_this(), [this] { end_of_backward(); });
}

void Group::end_of_backward() {
  end_queued = false;
  for (Unit* u : units) u->settle();
}

// Units by the shard tensor each registers in its module.
std::unordered_map<const c10::TensorImpl*, Unit*>& units_by_shard() {
  static std::unordered_map<const c10::TensorImpl*, Unit*> units;
  return units;
}

Unit* unit_of_shard(const at::Tensor& t) {
  auto it = units_by_shard().find(t.unsafeGetTensorImpl());
  return it == units_by_shard().end() ? nullptr : it->second;
}

// The unit a module parameter was taken into, if any.
Unit* unit_of(const at::Tensor& p) {
  for (const auto& r : intercept::roles_of(p))
    if (auto* u = dynamic_cast<Unit*>(r.first)) return u;
  return nullptr;
}

// Module keeps its parameter dictionary protected; a member pointer formed
// through a derived class reaches it (fully_shard takes the parameters out).
struct ParameterDict : torch::nn::Module {
  static torch::OrderedDict<std::string, at::Tensor>& of(torch::nn::Module& m) {
    torch::OrderedDict<std::string, at::Tensor> torch::nn::Module::*dict = &ParameterDict::parameters_;
    return m.*dict;
  }
};

// What fully_shard takes from `module`: each storage once (tied weights), and
// every name it was registered under, relative to `module`.
struct Taken {
  std::vector<at::Tensor> params;
  std::vector<Unit::Name> names;
};

Taken take_parameters(const torch::nn::Module& module) {
  Taken out;
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    const at::Tensor& p = item.value();
    if (unit_of_shard(p)) continue;  // a child's unit
    MESHTRAIN_CHECK(!unit_of(p), "zero::fully_shard: parameter '", item.key(), "' is tied to a parameter that an "
                    "earlier fully_shard call took into its unit; shard the modules that share it in one call");
    size_t index = out.params.size();
    for (size_t i = 0; i < out.params.size(); ++i)
      if (out.params[i].storage().is_alias_of(p.storage())) index = i;
    out.names.push_back({item.key(), index});
    if (index < out.params.size()) continue;
    MESHTRAIN_CHECK(p.is_contiguous() && p.storage_offset() == 0 &&
                        p.storage().nbytes() == static_cast<size_t>(p.numel()) * p.element_size(),
                    "zero::fully_shard: parameter '", item.key(), "' is a view into a larger tensor or not "
                    "contiguous; fully_shard needs each parameter to own its memory");
    MESHTRAIN_CHECK(out.params.empty() || p.scalar_type() == out.params.front().scalar_type(),
                    "zero::fully_shard: parameter '", item.key(), "' is ", p.scalar_type(), " while others in the unit are ",
                    out.params.front().scalar_type(), "; shard parameters of different dtypes in separate calls");
    out.params.push_back(p);
  }
  return out;
}

// Takes the unit's parameters out of the modules' dictionaries (the modules
// keep using them in forward) and registers the shard in `module` instead, so
// module.parameters() is what the optimizer must step, as with FSDP's flat
// parameters.
void register_shard(torch::nn::Module& module, const std::vector<Unit::Name>& names, const at::Tensor& shard) {
  for (const Unit::Name& n : names) {
    const size_t dot = n.name.rfind('.');
    torch::nn::Module* owner = &module;
    if (dot != std::string::npos) {
      for (const auto& item : module.named_modules("", /*include_self=*/false))
        if (item.key() == n.name.substr(0, dot)) owner = item.value().get();
    }
    ParameterDict::of(*owner).erase(dot == std::string::npos ? n.name : n.name.substr(dot + 1));
  }
  module.register_parameter(kShardName, shard, /*requires_grad=*/shard.requires_grad());
}

std::vector<Unit*> units_under(const torch::nn::Module& module) {
  std::vector<Unit*> units;
  for (const at::Tensor& p : module.parameters(/*recurse=*/true))
    if (Unit* u = unit_of_shard(p)) units.push_back(u);
  return units;
}

// The module's own (not its children's) parameters at full shape, under
// their names with `prefix`: units gathered (a collective over dp).
void add_full_parameters(const torch::nn::Module& m, const std::string& prefix, std::map<std::string, at::Tensor>& out) {
  for (const auto& item : m.named_parameters(/*recurse=*/false)) {
    if (Unit* u = unit_of_shard(item.value())) {
      const std::vector<at::Tensor> values = u->full_values();
      for (const Unit::Name& n : u->names()) out[prefix + n.name] = values[n.index];
    } else {
      intercept::Bypass bypass;
      out[prefix + item.key()] = item.value().detach().clone();
    }
  }
}

}  // namespace

void fully_shard(torch::nn::Module& module, const comm::CommPtr& dp, FullyShardOptions options) {
  MESHTRAIN_CHECK(dp, "zero::fully_shard needs a communicator");
  Taken taken = take_parameters(module);
  MESHTRAIN_CHECK(!taken.params.empty(), "zero::fully_shard: module '", module.name(), "' has no parameter that is "
                  "not already sharded (shard children first, then the parent for what is left)");
  auto group = group_of(dp);
  auto unit = std::make_shared<Unit>(std::move(taken.params), std::move(taken.names), dp, options, group);
  unit->start();
  group->units.push_back(unit.get());
  units_by_shard()[unit->shard().unsafeGetTensorImpl()] = unit.get();
  register_shard(module, unit->names(), unit->shard());
  // pp::pipeline and accumulation loops pause the reduction (dp/gradient_sync.h recurses into children).
  dp::register_gradient_sync(&module, unit, [u = unit.get()](bool on) { u->set_sync(on); });
}

std::vector<at::Tensor> sharded_parameters(const torch::nn::Module& module) {
  std::vector<at::Tensor> shards;
  for (Unit* u : units_under(module)) shards.push_back(u->shard());
  return shards;
}

std::map<std::string, at::Tensor> full_parameters(const torch::nn::Module& module) {
  std::map<std::string, at::Tensor> out;
  add_full_parameters(module, "", out);
  for (const auto& item : module.named_modules("", /*include_self=*/false)) add_full_parameters(*item.value(), item.key() + ".", out);
  return out;
}

int64_t held_parameter_bytes(const torch::nn::Module& module) {
  int64_t bytes = 0;
  std::vector<const c10::StorageImpl*> seen;
  for (const at::Tensor& p : module.parameters(/*recurse=*/true)) {
    if (Unit* u = unit_of_shard(p)) {
      bytes += u->held_bytes();
      continue;
    }
    const c10::StorageImpl* s = p.storage().unsafeGetStorageImpl();
    if (std::find(seen.begin(), seen.end(), s) != seen.end()) continue;
    seen.push_back(s);
    bytes += static_cast<int64_t>(s->nbytes());
  }
  return bytes;
}

}  // namespace zero
}  // namespace meshtrain
