#pragma once
// The load-balancing loss of a mixture of experts over a whole step's batch
// (models::MoE under AuxLossScope::kGlobal).
//
// Note [Global-batch balance loss]
// Switch Transformer's balance loss over the N tokens of the step's global
// batch (every micro-batch of every rank that holds other tokens: dp x cp):
//   L = E sum_e f_e P_e,  f_e = c_e / (N k),  P_e = (1/N) sum_t p_e(t)
// with c_e the routes that chose expert e and p_e(t) token t's router
// probability. f is a count, without a gradient, so
//   dL / dp_e(t) = E f_e / N   for every token t of the batch:
// a forward needs only S_e = sum over its own tokens of p_e(t), with its
// graph; f and N can wait until the backward. Each forward j contributes
//   L_j = m E sum_e f_e S_e^(j) / N    (m: the ranks of the token group)
// whose gradient reads f and N from the step's statistics when it runs. One
// rank's pieces add to m times its share of L, and the gradients' average
// over the m ranks (data-parallel gradients are means over dp x cp) is L's
// gradient, however the batch is split over ranks and micro-batches: the
// layout no longer changes the loss (Qiu et al. 2025 call it global-batch
// balancing). The statistics are E + 1 numbers per layer (route counts and
// tokens), added by every training forward and summed over the group once
// per step, at the first backward that reads them. So the loss is exact when
// every forward of the step precedes its first backward (one micro-batch,
// GPipe, the trainer's gradient accumulation under this scope); a training
// forward after that read, within a step opened by begin_step(), is refused.
// A recomputed forward (activation checkpointing) adds nothing: its counts
// came with the first pass.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace meshtrain {
namespace models {

// Which tokens the balance statistics cover: the step's global batch
// (Note [Global-batch balance loss]), or each forward's own tokens (one
// micro-batch of one rank; with a token group, the group's), the
// loss Megatron-LM's default aux_loss and DeepSpeed compute.
enum class AuxLossScope { kGlobal, kMicro };

// "global" | "micro"; ConfigError naming the value otherwise.
AuxLossScope parse_aux_loss_scope(const std::string& name);
std::string aux_loss_scope_name(AuxLossScope scope);

// The step's route counts and tokens of one or more MoE layers (one
// pipeline chunk's, shared), summed over the step's forwards and the token
// group. Not thread-safe: the forwards and backwards of a step run on one
// thread.
class BalanceStatistics {
 public:
  // Sums a double tensor over the ranks of the token group in place; every
  // rank of the group calls it at the same point of its step.
  using Reduce = std::function<void(at::Tensor&)>;

  // This process's forwards alone.
  BalanceStatistics() = default;
  // Over the `members` ranks that `reduce` sums over.
  BalanceStatistics(Reduce reduce, int members);

  // A layer of `experts` experts; returns its slot.
  int64_t add_layer(int64_t experts);
  // Starts a step: the last step's statistics are dropped, and until the
  // next begin_step a training forward after a backward read the totals is
  // an error (its tokens would miss the f the earlier backward used).
  // Without begin_step, such a forward starts the next step itself.
  void begin_step();
  // A training forward of layer `slot`: its routes per expert ([E] integers,
  // dropped ones included) and its tokens.
  void add(int64_t slot, const at::Tensor& routes_per_expert, int64_t tokens);
  // The step's totals of layer `slot`: [E + 1] doubles, routes per expert
  // and tokens over every forward of the step on every rank of the group.
  // The first call of a step sums every layer's over the group at once.
  at::Tensor totals(int64_t slot);
  int members() const { return members_; }

 private:
  Reduce reduce_;
  int members_ = 1;
  std::vector<int64_t> offsets_{0};  // slot s: [offsets_[s], offsets_[s + 1])
  at::Tensor sums_;                  // every slot's, this step (reduced once read)
  bool read_ = false;                // a backward has read this step's totals
  bool explicit_steps_ = false;      // begin_step was called
};

// One forward's piece of the global-batch balance loss: a scalar whose value
// is `own_value` (the forward's own balance loss, what the global one is
// when this forward is the whole batch) and whose backward gives
// `probability_sums` (S_e, [E]) the gradient m E f_e / N, with f and N from
// statistics->totals(slot) when the backward runs (see the note).
at::Tensor deferred_balance_loss(const at::Tensor& probability_sums, const at::Tensor& own_value,
                                 std::shared_ptr<BalanceStatistics> statistics, int64_t slot, int64_t top_k);

}  // namespace models
}  // namespace meshtrain
