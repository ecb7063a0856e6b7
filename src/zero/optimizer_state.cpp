#include "zero/optimizer_state.h"

#include <c10/util/string_utils.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include "meshtrain/util.h"

namespace meshtrain {
namespace zero {

namespace {

// libtorch 1.13 keys optimizer state by the TensorImpl's address as a string
// (2.x keys it by the pointer itself).
std::string key_of(const at::Tensor& p) { return c10::guts::to_string(p.unsafeGetTensorImpl()); }

void put(std::map<std::string, at::Tensor>& m, const char* name, const at::Tensor& t) {
  if (t.defined()) m[name] = t;
}

at::Tensor step_tensor(int64_t step) { return at::scalar_tensor(step, at::kLong); }

}  // namespace

void check_elementwise(const torch::optim::Optimizer& o) {
  const bool ok = dynamic_cast<const torch::optim::SGD*>(&o) || dynamic_cast<const torch::optim::Adam*>(&o) ||
                  dynamic_cast<const torch::optim::AdamW*>(&o) || dynamic_cast<const torch::optim::RMSprop*>(&o) ||
                  dynamic_cast<const torch::optim::Adagrad*>(&o);
  MESHTRAIN_CHECK(ok, "ZeRO: the optimizer must update each element from that element alone (SGD, Adam, AdamW, "
                  "RMSprop, Adagrad) so that each rank can step its shard; LBFGS and other non-elementwise "
                  "optimizers cannot be sharded");
}

std::map<std::string, at::Tensor> state_of(torch::optim::Optimizer& o, const at::Tensor& p) {
  std::map<std::string, at::Tensor> out;
  auto it = o.state().find(key_of(p));
  if (it == o.state().end()) return out;
  auto* s = it->second.get();
  if (auto* a = dynamic_cast<torch::optim::AdamWParamState*>(s)) {
    put(out, "exp_avg", a->exp_avg());
    put(out, "exp_avg_sq", a->exp_avg_sq());
    put(out, "max_exp_avg_sq", a->max_exp_avg_sq());
    out["step"] = step_tensor(a->step());
  } else if (auto* b = dynamic_cast<torch::optim::AdamParamState*>(s)) {
    put(out, "exp_avg", b->exp_avg());
    put(out, "exp_avg_sq", b->exp_avg_sq());
    put(out, "max_exp_avg_sq", b->max_exp_avg_sq());
    out["step"] = step_tensor(b->step());
  } else if (auto* g = dynamic_cast<torch::optim::SGDParamState*>(s)) {
    put(out, "momentum_buffer", g->momentum_buffer());
  } else if (auto* r = dynamic_cast<torch::optim::RMSpropParamState*>(s)) {
    put(out, "square_avg", r->square_avg());
    put(out, "momentum_buffer", r->momentum_buffer());
    put(out, "grad_avg", r->grad_avg());
    out["step"] = step_tensor(r->step());
  } else if (auto* d = dynamic_cast<torch::optim::AdagradParamState*>(s)) {
    put(out, "sum", d->sum());
    out["step"] = step_tensor(d->step());
  }
  return out;
}

void set_state(torch::optim::Optimizer& o, const at::Tensor& p, const std::map<std::string, at::Tensor>& st) {
  if (st.empty()) return;
  auto get = [&](const char* name) {
    auto it = st.find(name);
    return it == st.end() ? at::Tensor() : it->second.clone();
  };
  const int64_t step = st.count("step") ? st.at("step").item<int64_t>() : 0;
  std::unique_ptr<torch::optim::OptimizerParamState> state;
  if (dynamic_cast<torch::optim::AdamW*>(&o)) {
    auto s = std::make_unique<torch::optim::AdamWParamState>();
    s->step(step);
    s->exp_avg(get("exp_avg"));
    s->exp_avg_sq(get("exp_avg_sq"));
    s->max_exp_avg_sq(get("max_exp_avg_sq"));
    state = std::move(s);
  } else if (dynamic_cast<torch::optim::Adam*>(&o)) {
    auto s = std::make_unique<torch::optim::AdamParamState>();
    s->step(step);
    s->exp_avg(get("exp_avg"));
    s->exp_avg_sq(get("exp_avg_sq"));
    s->max_exp_avg_sq(get("max_exp_avg_sq"));
    state = std::move(s);
  } else if (dynamic_cast<torch::optim::SGD*>(&o)) {
    auto s = std::make_unique<torch::optim::SGDParamState>();
    s->momentum_buffer(get("momentum_buffer"));
    state = std::move(s);
  } else {
    throw ConfigError("loading optimizer state is supported for SGD, Adam and AdamW");
  }
  o.state()[key_of(p)] = std::move(state);
}

std::vector<int> group_of_params(const torch::optim::Optimizer& o, const std::vector<at::Tensor>& params) {
  std::vector<int> out(params.size(), -1);
  for (size_t g = 0; g < o.param_groups().size(); ++g) {
    for (const auto& q : o.param_groups()[g].params()) {
      for (size_t i = 0; i < params.size(); ++i) {
        if (params[i].unsafeGetTensorImpl() == q.unsafeGetTensorImpl()) out[i] = static_cast<int>(g);
      }
    }
  }
  return out;
}

void replace_params(torch::optim::Optimizer& o, const std::vector<at::Tensor>& pieces, const std::vector<int>& group_of) {
  MESHTRAIN_CHECK(o.state().empty(), "ZeRO: wrap the optimizer before its first step (it already holds state)");
  auto& groups = o.param_groups();
  for (auto& g : groups) g.params().clear();
  for (size_t i = 0; i < pieces.size(); ++i) {
    if (group_of[i] >= 0) groups[group_of[i]].params().push_back(pieces[i]);
  }
}

}  // namespace zero
}  // namespace meshtrain
