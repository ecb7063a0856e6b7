#pragma once
// meshtrain/moe.h: mixture of experts: the router, its balance losses and the MoE layer.
// Part of the public API (meshtrain/meshtrain.h includes it); the sections below
// are in dependency order.

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "meshtrain/nn.h"

// ===== moe balance =====
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

// ===== moe =====
// A mixture-of-experts MLP (Mixtral's sparse MoE block; Shazeer et al. 2017,
// Switch Transformer, Fedus et al. 2021): a router scores each token against
// E experts, the token goes to its top-k, and its output is the sum of those
// experts' outputs weighted by the router's probabilities renormalised over
// the k chosen (Mixtral). Each expert is a SwiGLU MLP, down(silu(gate x) *
// up x), as Mixtral's (or GPT's GELU MLP, fc2(gelu(fc1 x))).
//
// Dropless by default: every routed token is computed, however unbalanced
// the routing. With a capacity factor cf each expert takes at most
// ceil(cf * N * k / E) of the N tokens' k routes, in token order, and the
// rest are dropped (the token keeps its other routes; a token with none left
// passes as zero through this layer, the residual carries it) and counted.
//
// The auxiliary load-balancing loss (Switch Transformer eq. 4, for top-k):
// E * sum_e f_e * P_e, with f_e the fraction of the N k routes that chose
// expert e and P_e the router's mean probability of e; 1 when the routing is
// uniform, up to E when every token picks the same experts. Add coefficient x
// aux_loss() to the training loss (its gradient reaches the router through
// P_e), or set aux_loss_coef: the forward then attaches coef x aux_loss() to
// its output's backward (Megatron's MoEAuxLossAutoScaler), so the balance
// loss reaches the router on whichever pipeline stage the layer runs, with no
// change to the loss; aux_loss_scale (train::Trainer sets 1 / micro-batches,
// the scale of each micro-batch's loss, under the micro scope) multiplies it.
//
// Which tokens the statistics cover is aux_loss_scope (above):
//   global (default): the step's whole batch, every forward since the step
//     began on every rank of the balance statistics' group, f waiting for the
//     backward (Note [Global-batch balance loss]); train::Trainer gives the
//     layers of a pipeline chunk one BalanceStatistics over dp x cp, so every
//     layout trains like one process. Alone, a layer keeps its own, over
//     its token group when it has one. aux_loss()'s value is the forward's own
//     tokens' loss; its gradient is the global loss's share of them.
//   micro: the tokens of one forward; with a token group (the ranks that hold
//     other positions of the same sequences: context parallelism sets it
//     from outside through nn::TokenStatistics) the group's tokens: f_e from the group's routes (one all_reduce of E + 1 numbers
//     per forward), P_e from this rank's probabilities over the group's token
//     count, and aux_loss() is group size x this rank's share, so that its
//     mean over the group (the average the data-parallel gradients take) is
//     the balance loss of the whole sequences.
//
// The experts' weights are stacked along a leading expert dimension
// ([E, F, H] and [E, H, F]); element values come from (seed, name, index) as
// every built-in layer's (meshtrain/util.h). Expert parallelism is applied from
// outside (nn::ExpertParallel; the ep layer's parallelize gives an
// nn::ExpertGroup): a rank then keeps the slice [E/ep r, E/ep (r+1)) of
// exactly the values one process has. Each rank routes its own tokens, sends every route
// to the rank holding its expert (dispatch, one all_to_all), computes the
// routes it received, and sends the results back (combine), where they are
// weighted and added at their tokens; backward runs the same in reverse.
// The experts' gradients are those of the routes they computed, from every
// rank's tokens, divided by ep: the mean over the ep group's losses, as a
// data-parallel gradient is; average them over the ranks that hold the same
// experts (the dp replicas), never over ep. So that no data-parallel wrapper
// averages them over the wrong ranks, under ep > 1 the experts' weights are
// held apart from the module's parameters (expert_parameters(); to() and
// activation checkpointing include them); train::Trainer steps them over
// their replicas.

struct MoEOptions {
  MoEOptions(int64_t hidden, int64_t ffn_hidden, int64_t experts, int64_t top_k)
      : hidden_(hidden), ffn_hidden_(ffn_hidden), experts_(experts), top_k_(top_k) {}
  TORCH_ARG(int64_t, hidden);
  TORCH_ARG(int64_t, ffn_hidden);
  TORCH_ARG(int64_t, experts);
  TORCH_ARG(int64_t, top_k);
  TORCH_ARG(double, capacity_factor) = 0;  // 0: dropless
  TORCH_ARG(bool, swiglu) = true;          // false: GELU experts (fc1, fc2 with biases off)
  TORCH_ARG(bool, gelu_tanh) = false;      // GELU experts: the tanh approximation (GPT-2's)
  // > 0: coef x aux_loss() joins the output's backward (see above); 0: add it yourself.
  TORCH_ARG(double, aux_loss_coef) = 0;
  // The tokens the balance statistics cover (see above).
  TORCH_ARG(AuxLossScope, aux_loss_scope) = AuxLossScope::kGlobal;
  TORCH_ARG(uint64_t, seed) = 1234;
  TORCH_ARG(std::string, name) = "moe";    // prefix of the parameters' init names
};

// What forwards routed: the last one (routing()), or every training forward
// since the last take_load() (those that record a graph, and a checkpointed
// block's first pass, which runs without one; its recompute adds nothing).
struct MoELoad {
  at::Tensor tokens_per_expert;  // [E] int64
  int64_t dropped = 0;
};
struct MoERouting {
  at::Tensor tokens_per_expert;  // [E] int64: routes each expert computed
  int64_t dropped = 0;           // routes dropped for capacity
  at::Tensor aux_loss;           // scalar, with the router's graph
};

struct MoEImpl : torch::nn::Module, nn::TokenStatistics, nn::ExpertParallel {
  explicit MoEImpl(const MoEOptions& options);
  // [..., H] -> [..., H]
  at::Tensor forward(const at::Tensor& x);
  const MoERouting& routing() const { return routing_; }
  at::Tensor aux_loss() const { return routing_.aux_loss; }
  MoELoad take_load();
  // Expert parallelism: keeps this rank's slice of the experts, each of them
  // taken out of parameters() and held apart (see above); the router stays.
  void parallelize_experts(std::shared_ptr<nn::ExpertGroup> group) override;
  const std::shared_ptr<nn::ExpertGroup>& expert_group() const override { return group_; }
  int64_t num_experts() const override { return options.experts(); }
  // Under expert parallelism (ep > 1): this rank's expert weights, held apart
  // from parameters() (see above), by name ("gate", "up", "down" or "fc1",
  // "fc2"); empty otherwise (they are parameters then).
  const std::vector<std::pair<std::string, at::Tensor>>& expert_parameters() const { return apart_; }
  using torch::nn::Module::to;
  void to(torch::Dtype dtype, bool non_blocking = false) override;
  void to(torch::Device device, torch::Dtype dtype, bool non_blocking = false) override;
  // The backward's multiplier of aux_loss_coef x aux_loss() (train::Trainer:
  // 1 / micro-batches under the micro scope, 1 under the global one, whose
  // pieces add up to the step's loss).
  double aux_loss_scale = 1.0;
  // The global scope's statistics: shared by the layers of a pipeline chunk
  // and summed over the ranks holding other tokens (train::Trainer sets
  // them); the layer registers itself in them.
  void set_balance_statistics(std::shared_ptr<BalanceStatistics> statistics);
  // The ranks holding the other tokens of this rank's sequences (context
  // parallelism): the micro scope's statistics over their tokens, and the
  // global scope's while the layer keeps its own statistics.
  void set_token_group(Sum sum, int members) override;
  const std::shared_ptr<BalanceStatistics>& balance_statistics() const { return balance_; }

  MoEOptions options;
  at::Tensor router;  // [E, H]
  at::Tensor w_in;    // [E, F, H] gate (swiglu) or fc1 ([E/ep, F, H] under expert parallelism)
  at::Tensor w_up;    // [E, F, H] up (swiglu); undefined otherwise
  at::Tensor w_out;   // [E, H, F] down or fc2

 private:
  at::Tensor expert(int64_t e, const at::Tensor& tokens, const std::vector<at::Tensor>& weights) const;
  // Each row through its expert (unweighted): rows [M, H] with expert ids in
  // this rank's slice; the parallel one sends them to the experts' ranks and back.
  at::Tensor run_experts(const at::Tensor& rows, const at::Tensor& expert_of_row);
  at::Tensor run_experts_parallel(const at::Tensor& rows, const at::Tensor& expert_of_row);
  at::Tensor balance_loss(const at::Tensor& probs, const at::Tensor& route_expert);
  at::Tensor global_balance_loss(const at::Tensor& probs, const at::Tensor& chosen);
  void record(const at::Tensor& computed, int64_t dropped, const at::Tensor& chosen, int64_t tokens);
  int64_t first_expert_ = 0;  // of this rank's slice
  std::shared_ptr<nn::ExpertGroup> group_;  // null: every expert here
  MoERouting routing_;
  MoELoad load_;
  std::vector<std::pair<std::string, at::Tensor>> apart_;
  std::shared_ptr<BalanceStatistics> balance_;
  int64_t balance_slot_ = 0;
  bool own_balance_ = true;  // balance_ is the layer's own, not set_balance_statistics's
  Sum token_sum_;            // the token group's (null: none)
  int token_members_ = 1;
};
TORCH_MODULE(MoE);

// The route slots a capacity keeps: for routes [N k] listed token by token
// (expert ids), true for the first `capacity` routes of each expert; all true
// when capacity < 0 (dropless).
at::Tensor routes_within_capacity(const at::Tensor& expert_of_route, int64_t experts, int64_t capacity);
// ceil(cf * tokens * top_k / experts); -1 for cf <= 0 (dropless).
int64_t expert_capacity(double capacity_factor, int64_t tokens, int64_t top_k, int64_t experts);

}  // namespace models
}  // namespace meshtrain
