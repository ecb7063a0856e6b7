#pragma once
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
// Which tokens the statistics cover is aux_loss_scope (moe_balance.h):
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
// every built-in layer's (util/init.h). Expert parallelism is applied from
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

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "meshtrain/models/moe_balance.h"
#include "meshtrain/nn/experts.h"

namespace meshtrain {
namespace models {

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
