// zero::fully_shard on plain modules: see include/meshtrain/zero.h.
#include "meshtrain/zero.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <functional>
#include <set>
#include <unordered_map>

#include "dp/gradient_sync.h"
#include "meshtrain/util.h"
#include "zero/optimizer_state.h"
#include "util/shard.h"
#include "util/autograd_hooks.h"
#include "util/intercept.h"
#include "util/parameter_dict.h"

namespace meshtrain {
namespace zero {

namespace {

class Unit;

// The units of one communicator on this process: an operation on one unit
// frees the others, and one end-of-backward callback settles them all.
struct Group : std::enable_shared_from_this<Group> {
  std::vector<Unit*> units;  // units live as long as the registry (the process)
  bool end_queued = false;
  int64_t gathered_bytes = 0, peak_gathered_bytes = 0;
  void add_gathered(int64_t bytes) {
    gathered_bytes += bytes;
    peak_gathered_bytes = std::max(peak_gathered_bytes, gathered_bytes);
  }
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
    compute_ = options_.param_dtype().value_or(params_.front().scalar_type());
  }
  ~Unit() override;  // leaves its group (intercept::forget_all may end a unit before the process)

  // Takes rank 0's values, keeps this rank's part, frees the parameters.
  void start() {
    at::NoGradGuard no_grad;
    intercept::Bypass bypass;
    std::vector<at::Tensor> flat;
    for (const at::Tensor& p : params_) flat.push_back(p.detach().reshape({-1}));
    at::Tensor full = at::cat(flat);
    dp_->broadcast(full, 0);
    shard_ = full.narrow(0, mine_.offset, mine_.size).clone().requires_grad_(trainable_ > 0);
    if (compute_ != shard_.scalar_type()) compute_in(compute_);
    std::vector<at::Tensor> trainable;
    std::vector<size_t> index;  // trainable[k] is params_[index[k]]
    for (size_t i = 0; i < params_.size(); ++i) {
      if (params_[i].requires_grad()) trainable.push_back(params_[i]), index.push_back(i);
    }
    accumulators_ = hooks::on_grad_ready(trainable, weak_from_this(), [this, index](size_t k) { grad_ready(index[k]); });
    for (size_t i = 0; i < params_.size(); ++i) intercept::mark(params_[i], shared_from_this(), static_cast<int>(i));
    gathered_ = true;  // the module's own values until now: freed without counting as a gather
    group_->gathered_bytes += gathered_bytes();
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
    at::Tensor flat = at::zeros({total_}, shard_.options().dtype(compute_).requires_grad(false));
    for (size_t i = 0; i < params_.size(); ++i) {
      at::Tensor& g = params_[i].mutable_grad();
      if (g.defined()) flat.narrow(0, offsets_[i], params_[i].numel()).copy_(g.reshape({-1}));
      g.reset();
    }
    at::Tensor mine = dp_->reduce_scatter(flat, comm::ReduceOp::kAvg).to(shard_.scalar_type());
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
    group_->gathered_bytes -= gathered_bytes();
  }

  void gather() {
    at::NoGradGuard no_grad;
    intercept::Bypass bypass;
    const at::Tensor full = dp_->all_gather_flat(shard_.detach().to(compute_));
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
    group_->add_gathered(gathered_bytes());
  }

  // Every parameter at full shape (collective over dp).
  std::vector<at::Tensor> full_values() const { return gather_params(shard_); }

  // Mixed precision: the layers' parameters take the compute dtype in place
  // (same TensorImpl and storage, so other roles' marks on them hold), before
  // any gradient hook exists, so autograd accumulates their gradients in it.
  void compute_in(at::ScalarType dtype) {
    for (const at::Tensor& p : params_) {
      MESHTRAIN_CHECK(p.is_floating_point(), "zero::fully_shard: param_dtype ", dtype, " for a ", p.scalar_type(),
                      " parameter; shard parameters that are not floating point without param_dtype");
      p.unsafeGetTensorImpl()->set_storage_and_dtype(p.storage(), caffe2::TypeMeta::fromScalarType(dtype));
    }
  }

  // Parameter i's part of this rank's shard, or an empty range.
  struct Piece {
    int64_t in_param = 0, in_shard = 0, numel = 0;
  };
  Piece piece(size_t i) const {
    const int64_t lo = std::max(offsets_[i], mine_.offset), hi = std::min(offsets_[i] + params_[i].numel(), mine_.end());
    if (lo >= hi) return {};
    return {lo - offsets_[i], lo - mine_.offset, hi - lo};
  }
  size_t num_params() const { return params_.size(); }
  const at::Tensor& param(size_t i) const { return params_[i]; }
  // The name parameter i goes by: its first.
  const std::string& name_of(size_t i) const {
    for (const Name& n : names_)
      if (n.index == i) return n.name;
    MESHTRAIN_CHECK(false, "zero::fully_shard: parameter ", i, " of a unit has no name");
    return names_.front().name;
  }

  // Sets the shard from full tensors by parameter (values, or one optimizer
  // state kind), as `like` the shard.
  at::Tensor shard_of(const std::vector<at::Tensor>& full) const {
    at::Tensor out = at::empty({mine_.size}, shard_.options().requires_grad(false));
    for (size_t i = 0; i < params_.size(); ++i) {
      const Piece p = piece(i);
      if (p.numel > 0) out.narrow(0, p.in_shard, p.numel).copy_(full[i].reshape({-1}).narrow(0, p.in_param, p.numel));
    }
    return out;
  }
  // New shard values (a checkpoint): gathered copies are stale from now on.
  void set_shard(const at::Tensor& values) {
    at::NoGradGuard no_grad;
    shard_.detach().copy_(values);
    free();
  }

  // Each parameter's full tensor of `flat_shard` (this rank's part, shard-sized) from every rank's (collective over dp).
  std::vector<at::Tensor> gather_params(const at::Tensor& flat_shard) const {
    intercept::Bypass bypass;
    const at::Tensor full = dp_->all_gather_flat(flat_shard.detach());
    std::vector<at::Tensor> out;
    for (size_t i = 0; i < params_.size(); ++i)
      out.push_back(full.narrow(0, offsets_[i], params_[i].numel()).view(params_[i].sizes()).clone());
    return out;
  }

  const at::Tensor& shard() const { return shard_; }
  const std::vector<Name>& names() const { return names_; }
  // The shard plus whatever the parameters' storage holds now (measured, not inferred from gathered_).
  int64_t gathered_bytes() const { return total_ * c10::elementSize(compute_); }
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
  at::ScalarType compute_;  // of the gathered parameters and their gradients
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

Unit::~Unit() {
  group_->units.erase(std::remove(group_->units.begin(), group_->units.end(), this), group_->units.end());
  auto it = units_by_shard().find(shard_.unsafeGetTensorImpl());
  if (it != units_by_shard().end() && it->second == this) units_by_shard().erase(it);
}

Unit* unit_of_shard(const at::Tensor& t) {
  auto it = units_by_shard().find(t.unsafeGetTensorImpl());
  return it == units_by_shard().end() ? nullptr : it->second;
}

// The unit a module parameter was taken into, if any.
Unit* unit_of(const at::Tensor& p) { return intercept::role_of<Unit>(p); }

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

// Each unit registered in `module` or below, with the name prefix of the module that registered it.
void for_each_unit(const torch::nn::Module& module, const std::function<void(Unit&, const std::string&)>& fn) {
  auto visit = [&](const torch::nn::Module& m, const std::string& prefix) {
    for (const auto& item : m.named_parameters(/*recurse=*/false))
      if (Unit* u = unit_of_shard(item.value())) fn(*u, prefix);
  };
  visit(module, "");
  for (const auto& item : module.named_modules("", /*include_self=*/false)) visit(*item.value(), item.key() + ".");
}

// The full tensors of one unit's parameters (or their optimizer state of one
// kind) from `by_name`; a missing one is refused, or taken as zeros when
// `zeros_if_missing` (a parameter the optimizer has no such state for yet);
// a misshapen one is refused.
std::vector<at::Tensor> unit_tensors(const Unit& u, const std::string& prefix,
                                     const std::function<const at::Tensor*(const std::string&)>& by_name,
                                     const std::string& what, bool zeros_if_missing = false) {
  std::vector<at::Tensor> out;
  for (size_t i = 0; i < u.num_params(); ++i) {
    const std::string name = prefix + u.name_of(i);
    const at::Tensor* t = by_name(name);
    if ((!t || !t->defined()) && zeros_if_missing) {
      out.push_back(at::zeros({u.param(i).numel()}, at::kFloat));
      continue;
    }
    MESHTRAIN_CHECK(t && t->defined(), "zero::load_state: the state has no ", what, " for parameter '", name,
                    "' (saved from another model?)");
    MESHTRAIN_CHECK(t->numel() == u.param(i).numel(), "zero::load_state: ", what, " of parameter '", name, "' has ",
                    t->numel(), " elements but the model's has ", u.param(i).numel());
    out.push_back(*t);
  }
  return out;
}

// The optimizer state of a unit's parameters as its shard's: every kind any of
// them has (zeros for those without), the step of any.
std::map<std::string, at::Tensor> shard_optimizer_state(const Unit& u, const std::string& prefix, const FullState& state) {
  std::map<std::string, at::Tensor> out;
  std::set<std::string> kinds;
  for (size_t i = 0; i < u.num_params(); ++i) {
    auto p = state.optimizer.find(prefix + u.name_of(i));
    if (p == state.optimizer.end()) continue;
    for (const auto& kind : p->second) {
      if (kind.first == "step") out.emplace("step", kind.second);
      else kinds.insert(kind.first);
    }
  }
  for (const std::string& kind : kinds) {
    out[kind] = u.shard_of(unit_tensors(u, prefix, [&](const std::string& name) -> const at::Tensor* {
      auto p = state.optimizer.find(name);
      if (p == state.optimizer.end()) return nullptr;
      auto k = p->second.find(kind);
      return k == p->second.end() ? nullptr : &k->second;
    }, "optimizer state '" + kind + "'", /*zeros_if_missing=*/true));
  }
  return out;
}

void load_unit(Unit& u, const std::string& prefix, torch::optim::Optimizer& optimizer, const FullState& state) {
  u.set_shard(u.shard_of(unit_tensors(u, prefix, [&](const std::string& name) -> const at::Tensor* {
    auto it = state.parameters.find(name);
    return it == state.parameters.end() ? nullptr : &it->second;
  }, "value")));
  const std::map<std::string, at::Tensor> shard_state = shard_optimizer_state(u, prefix, state);
  if (!shard_state.empty()) set_state(optimizer, u.shard(), shard_state);
}

// A parameter no unit took (a module sharded in part): its value and state as they are.
void load_unsharded(const dp::NamedParam& p, torch::optim::Optimizer& optimizer, const FullState& state) {
  auto value = state.parameters.find(p.name);
  MESHTRAIN_CHECK(value != state.parameters.end(), "zero::load_state: the state has no value for parameter '", p.name,
                  "' (saved from another model?)");
  MESHTRAIN_CHECK(value->second.numel() == p.tensor.numel(), "zero::load_state: parameter '", p.name, "' has ",
                  value->second.numel(), " elements in the state but ", p.tensor.numel(), " in the model");
  at::NoGradGuard no_grad;
  p.tensor.detach().copy_(value->second.reshape(p.tensor.sizes()));
  auto opt = state.optimizer.find(p.name);
  if (opt == state.optimizer.end()) return;
  std::map<std::string, at::Tensor> st;
  for (const auto& kv : opt->second) st[kv.first] = kv.first == "step" ? kv.second : kv.second.reshape(p.tensor.sizes());
  set_state(optimizer, p.tensor, st);
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

std::vector<dp::NamedParam> original_parameters(const torch::nn::Module& module) {
  std::vector<dp::NamedParam> out;
  for (const auto& p : dp::unique_parameters(module))
    if (!unit_of_shard(p.tensor)) out.push_back(p);
  for_each_unit(module, [&](Unit& u, const std::string& prefix) {
    for (size_t i = 0; i < u.num_params(); ++i) out.push_back({prefix + u.name_of(i), u.param(i)});
  });
  return out;
}

std::vector<OwnedPiece> owned_pieces(const torch::nn::Module& module, torch::optim::Optimizer& optimizer) {
  std::vector<OwnedPiece> out;
  for_each_unit(module, [&](Unit& u, const std::string& prefix) {
    const std::map<std::string, at::Tensor> state = state_of(optimizer, u.shard());
    for (size_t i = 0; i < u.num_params(); ++i) {
      const Unit::Piece p = u.piece(i);
      if (p.numel == 0) continue;
      OwnedPiece piece{prefix + u.name_of(i), p.in_param, u.shard().detach().narrow(0, p.in_shard, p.numel), {}};
      for (const auto& kv : state)
        piece.state[kv.first] = kv.first == "step" ? kv.second : kv.second.narrow(0, p.in_shard, p.numel);
      out.push_back(std::move(piece));
    }
  });
  return out;
}

std::vector<std::pair<std::string, at::Tensor>> shard_gradients(const torch::nn::Module& module) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for_each_unit(module, [&](Unit& u, const std::string& prefix) {
    if (!u.shard().grad().defined()) return;
    for (size_t i = 0; i < u.num_params(); ++i) {
      const Unit::Piece p = u.piece(i);
      if (p.numel > 0) out.emplace_back(prefix + u.name_of(i), u.shard().grad().narrow(0, p.in_shard, p.numel));
    }
  });
  return out;
}

FullState full_state(const torch::nn::Module& module, torch::optim::Optimizer& optimizer) {
  FullState out;
  out.parameters = full_parameters(module);
  for (const auto& p : dp::unique_parameters(module)) {
    if (unit_of_shard(p.tensor)) continue;
    for (const auto& kv : state_of(optimizer, p.tensor)) out.optimizer[p.name][kv.first] = kv.second.clone();
  }
  for_each_unit(module, [&](Unit& u, const std::string& prefix) {
    for (const auto& kv : state_of(optimizer, u.shard())) {  // the same kinds on every rank (an elementwise optimizer)
      const std::vector<at::Tensor> full = kv.first == "step" ? std::vector<at::Tensor>() : u.gather_params(kv.second);
      for (const Unit::Name& n : u.names())
        out.optimizer[prefix + n.name][kv.first] = kv.first == "step" ? kv.second.clone() : full[n.index];
    }
  });
  return out;
}

void load_state(torch::nn::Module& module, torch::optim::Optimizer& optimizer, const FullState& state) {
  for (const auto& p : dp::unique_parameters(module))
    if (!unit_of_shard(p.tensor)) load_unsharded(p, optimizer, state);
  for_each_unit(module, [&](Unit& u, const std::string& prefix) { load_unit(u, prefix, optimizer, state); });
}

int64_t peak_gathered_bytes(const comm::CommPtr& dp) { return group_of(dp)->peak_gathered_bytes; }

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
