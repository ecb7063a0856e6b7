// The global-batch balance loss: see Note [Global-batch balance loss] in the header.
#include "meshtrain/moe.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>

#include "meshtrain/util.h"

namespace meshtrain {
namespace models {

AuxLossScope parse_aux_loss_scope(const std::string& name) {
  if (name == "global") return AuxLossScope::kGlobal;
  if (name == "micro") return AuxLossScope::kMicro;
  throw ConfigError(str_cat("--aux-loss-scope '", name, "' is not a scope; use global (the balance loss over the "
                            "step's whole batch, the same on every layout) or micro (each micro-batch's own, per "
                            "rank: Megatron-LM's and DeepSpeed's default)"));
}

std::string aux_loss_scope_name(AuxLossScope scope) { return scope == AuxLossScope::kGlobal ? "global" : "micro"; }

BalanceStatistics::BalanceStatistics(Reduce reduce, int members) : reduce_(std::move(reduce)), members_(members) {
  MESHTRAIN_CHECK(members_ >= 1 && (reduce_ || members_ == 1), "BalanceStatistics: ", members_, " members need a "
                  "reduce function summing over them; give one, or 1 member");
}

int64_t BalanceStatistics::add_layer(int64_t experts) {
  MESHTRAIN_CHECK(experts >= 1, "BalanceStatistics: a layer of ", experts, " experts; give at least 1");
  MESHTRAIN_CHECK(!sums_.defined(), "BalanceStatistics: a layer added after the step's first forward; add every "
                  "layer before training");
  offsets_.push_back(offsets_.back() + experts + 1);
  return static_cast<int64_t>(offsets_.size()) - 2;
}

void BalanceStatistics::begin_step() {
  explicit_steps_ = true;
  sums_ = at::Tensor();
  read_ = false;
}

void BalanceStatistics::add(int64_t slot, const at::Tensor& routes_per_expert, int64_t tokens) {
  if (read_) {  // a backward used this step's counts: this forward's tokens would miss them
    MESHTRAIN_CHECK(!explicit_steps_, "the mixture of experts' global-batch balance loss (aux_loss_scope global) "
                    "needs every forward of a step before its first backward, and a forward came after a backward "
                    "had used the step's expert counts; run the step's forwards first (pipeline schedule gpipe, "
                    "--schedule gpipe), or use the per-micro-batch loss (--aux-loss-scope micro)");
    sums_ = at::Tensor();  // without begin_step: the next step starts here
    read_ = false;
  }
  if (!sums_.defined()) sums_ = at::zeros({offsets_.back()}, at::kDouble);
  const int64_t experts = offsets_.at(slot + 1) - offsets_.at(slot) - 1;
  MESHTRAIN_CHECK(routes_per_expert.numel() == experts, "BalanceStatistics: layer ", slot, " has ", experts,
                  " experts; got counts of ", routes_per_expert.numel());
  at::Tensor mine = sums_.narrow(0, offsets_[slot], experts + 1);
  mine.narrow(0, 0, experts).add_(routes_per_expert.to(at::kDouble));
  mine[experts] += static_cast<double>(tokens);
}

at::Tensor BalanceStatistics::totals(int64_t slot) {
  MESHTRAIN_CHECK(sums_.defined(), "BalanceStatistics: totals of a step without a training forward");
  if (!read_) {
    if (reduce_ && members_ > 1) reduce_(sums_);  // once per step: every layer's E + 1 numbers together
    read_ = true;
  }
  return sums_.narrow(0, offsets_.at(slot), offsets_.at(slot + 1) - offsets_.at(slot));
}

namespace {

// The backward of deferred_balance_loss: S_e's gradient m E f_e / N, with
// f = c / (N k) from the step's totals, read when it runs.
class DeferredBalanceBackward : public torch::autograd::Node {
 public:
  DeferredBalanceBackward(std::shared_ptr<BalanceStatistics> statistics, int64_t slot, int64_t top_k,
                          at::ScalarType dtype)
      : statistics_(std::move(statistics)), slot_(slot), top_k_(top_k), dtype_(dtype) {}

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    if (!grads[0].defined()) return {at::Tensor()};
    const at::Tensor totals = statistics_->totals(slot_);
    const int64_t E = totals.numel() - 1;
    const double tokens = totals[E].item<double>();
    const at::Tensor f = totals.narrow(0, 0, E) / (tokens * static_cast<double>(top_k_));
    const at::Tensor per_probability = f * (static_cast<double>(E * statistics_->members()) / tokens);
    return {per_probability.to(dtype_) * grads[0].to(dtype_)};
  }
  std::string name() const override { return "meshtrain::DeferredBalanceBackward"; }

 private:
  std::shared_ptr<BalanceStatistics> statistics_;
  int64_t slot_, top_k_;
  at::ScalarType dtype_;
};

}  // namespace

at::Tensor deferred_balance_loss(const at::Tensor& probability_sums, const at::Tensor& own_value,
                                 std::shared_ptr<BalanceStatistics> statistics, int64_t slot, int64_t top_k) {
  at::Tensor out = own_value.detach().clone();
  if (!at::GradMode::is_enabled() || !probability_sums.requires_grad()) return out;
  auto node = std::shared_ptr<DeferredBalanceBackward>(
      new DeferredBalanceBackward(std::move(statistics), slot, top_k, probability_sums.scalar_type()),
      torch::autograd::deleteNode);
  node->set_next_edges(torch::autograd::collect_next_edges(probability_sums));
  torch::autograd::create_gradient_edge(out, node);
  return out;
}

}  // namespace models
}  // namespace meshtrain
