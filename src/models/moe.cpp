// The mixture-of-experts MLP: see the header for the math. Each expert runs
// once on the rows routed to it (here, or on its rank under expert
// parallelism), and the weighted outputs are added back at their tokens.
#include "meshtrain/moe.h"

#include <ATen/ATen.h>
#include <torch/autograd.h>

#include <cmath>

#include "meshtrain/models.h"
#include "meshtrain/util.h"

namespace meshtrain {
namespace models {

namespace {

// The output unchanged; in backward, `scale` as the gradient of the scalar
// `aux` (Megatron's MoEAuxLossAutoScaler): the balance loss joins the backward
// wherever the layer's output is used, on any pipeline stage.
struct AttachAuxLoss : torch::autograd::Function<AttachAuxLoss> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& out, const at::Tensor& aux,
                            double scale) {
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["dtype"] = aux.scalar_type();
    return out;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const at::Tensor aux_grad = at::scalar_tensor(ctx->saved_data["scale"].toDouble(),
                                                  at::TensorOptions().dtype(ctx->saved_data["dtype"].toScalarType()));
    return {grads[0], aux_grad, at::Tensor()};
  }
};

// The input unchanged; its gradient times `scale` (an expert's weights under
// expert parallelism: the mean over the ep group's losses).
struct ScaleGradient : torch::autograd::Function<ScaleGradient> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& w, double scale) {
    ctx->saved_data["scale"] = scale;
    return w;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    return {grads[0] * ctx->saved_data["scale"].toDouble(), at::Tensor()};
  }
};

}  // namespace

int64_t expert_capacity(double capacity_factor, int64_t tokens, int64_t top_k, int64_t experts) {
  if (capacity_factor <= 0) return -1;
  return static_cast<int64_t>(std::ceil(capacity_factor * static_cast<double>(tokens * top_k) / experts));
}

at::Tensor routes_within_capacity(const at::Tensor& expert_of_route, int64_t experts, int64_t capacity) {
  if (capacity < 0) return at::ones({expert_of_route.size(0)}, at::TensorOptions().dtype(at::kBool));
  // The rank of each route among its expert's routes, in route order.
  const at::Tensor seen = at::one_hot(expert_of_route, experts).cumsum(0);
  const at::Tensor rank = seen.gather(1, expert_of_route.unsqueeze(1)).squeeze(1) - 1;
  return rank < capacity;
}

MoEImpl::MoEImpl(const MoEOptions& o) : options(o) {
  const int64_t E = o.experts(), F = o.ffn_hidden(), H = o.hidden();
  MESHTRAIN_CHECK(E >= 1 && o.top_k() >= 1 && o.top_k() <= E, "--top-k ", o.top_k(),
                  " routes each token to that many of --experts ", E, "; choose --top-k between 1 and ", E);
  MESHTRAIN_CHECK(H >= 1 && F >= 1, "MoE: hidden ", H, " and ffn_hidden ", F, " must be positive");
  const InitSpec normal = InitSpec::normal(0, 0.02);
  router = register_parameter("router", init_full(o.seed(), o.name() + ".router", normal, {E, H}));
  auto experts = [&](const std::string& name, std::vector<int64_t> shape) {
    return register_parameter(name, init_full(o.seed(), o.name() + "." + name, normal, shape));
  };
  w_in = experts(o.swiglu() ? "gate" : "fc1", {E, F, H});
  if (o.swiglu()) w_up = experts("up", {E, F, H});
  w_out = experts(o.swiglu() ? "down" : "fc2", {E, H, F});
  // Alone, the global scope covers this process's forwards (and its token group's, once set).
  set_balance_statistics(std::make_shared<BalanceStatistics>());
  own_balance_ = true;
}

void MoEImpl::set_balance_statistics(std::shared_ptr<BalanceStatistics> statistics) {
  MESHTRAIN_CHECK(statistics, "MoE '", options.name(), "': balance statistics must not be null");
  balance_slot_ = statistics->add_layer(options.experts());
  balance_ = std::move(statistics);
  own_balance_ = false;
}

void MoEImpl::set_token_group(Sum sum, int members) {
  MESHTRAIN_CHECK(members >= 1 && (sum || members == 1), "MoE '", options.name(), "': a token group of ", members,
                  " ranks needs a function summing over them");
  token_sum_ = members > 1 ? std::move(sum) : nullptr;
  token_members_ = members;
  if (!own_balance_) return;  // statistics given from outside (the trainer's over dp x cp) stay
  set_balance_statistics(token_sum_ ? std::make_shared<BalanceStatistics>(token_sum_, members)
                                    : std::make_shared<BalanceStatistics>());
  own_balance_ = true;
}

void MoEImpl::parallelize_experts(std::shared_ptr<nn::ExpertGroup> group) {
  const int64_t E = options.experts();
  MESHTRAIN_CHECK(group, "MoE '", options.name(), "': an expert group must not be null");
  MESHTRAIN_CHECK(!group_, "MoE '", options.name(), "': its experts are already spread over a group; do it once");
  MESHTRAIN_CHECK(E % group->size() == 0, "MoE '", options.name(), "': ep ", group->size(), " does not divide its ", E,
                  " experts (each ep rank holds experts / ep of them); choose an ep dividing ", E);
  group_ = std::move(group);
  if (group_->size() == 1) return;
  // This rank's slice [first, first + count) of each expert tensor, held
  // apart from the module's parameters (see the header): the values one
  // process has, so that every layout starts alike.
  const int64_t count = E / group_->size();
  first_expert_ = count * group_->rank();
  at::NoGradGuard no_grad;
  auto slice = [&](at::Tensor& w, const std::string& name) {
    at::Tensor mine = w.narrow(0, first_expert_, count).clone().requires_grad_(w.requires_grad());
    parameters_.erase(name);
    apart_.emplace_back(name, mine);
    w = mine;
  };
  slice(w_in, options.swiglu() ? "gate" : "fc1");
  if (options.swiglu()) slice(w_up, "up");
  slice(w_out, options.swiglu() ? "down" : "fc2");
}

void MoEImpl::to(torch::Dtype dtype, bool non_blocking) {
  torch::nn::Module::to(dtype, non_blocking);
  for (auto& p : apart_) p.second.set_data(p.second.to(dtype, non_blocking));
}

void MoEImpl::to(torch::Device device, torch::Dtype dtype, bool non_blocking) {
  torch::nn::Module::to(device, dtype, non_blocking);
  for (auto& p : apart_) p.second.set_data(p.second.to(device, dtype, non_blocking));
}

// weights: w_in, w_up (undefined without SwiGLU), w_out.
at::Tensor MoEImpl::expert(int64_t e, const at::Tensor& tokens, const std::vector<at::Tensor>& w) const {
  const at::Tensor inner = at::matmul(tokens, w[0][e].t());
  const at::Tensor act = options.swiglu() ? at::silu(inner) * at::matmul(tokens, w[1][e].t())
                                          : at::gelu(inner, options.gelu_tanh() ? "tanh" : "none");
  return at::matmul(act, w[2][e].t());
}

at::Tensor MoEImpl::forward(const at::Tensor& x) {
  const int64_t H = x.size(-1), E = options.experts(), k = options.top_k();
  const at::Tensor tokens = x.reshape({-1, H});
  const int64_t N = tokens.size(0);
  // Router statistics in fp32 whatever x's dtype (fp64 stays fp64).
  const at::ScalarType stats = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const at::Tensor probs = at::softmax(at::matmul(tokens, router.t()).to(stats), -1);  // [N, E]
  const auto top = probs.topk(k, -1);
  const at::Tensor top_p = std::get<0>(top), top_e = std::get<1>(top);  // [N, k]
  // Routes listed token by token: route i is token i / k's (i % k)-th choice.
  const at::Tensor route_expert = top_e.reshape(-1);
  const at::Tensor route_weight = (top_p / top_p.sum(-1, /*keepdim=*/true)).reshape(-1).to(x.scalar_type());
  const at::Tensor route_token = at::arange(N, top_e.options()).repeat_interleave(k);
  const at::Tensor kept = routes_within_capacity(route_expert, E, expert_capacity(options.capacity_factor(), N, k, E))
                              .nonzero()
                              .squeeze(1);
  const at::Tensor token = route_token.index_select(0, kept), expert_id = route_expert.index_select(0, kept);
  const at::Tensor rows = tokens.index_select(0, token);
  const bool parallel = group_ && group_->size() > 1;
  const at::Tensor results = parallel ? run_experts_parallel(rows, expert_id) : run_experts(rows, expert_id);
  const at::Tensor out =
      at::zeros_like(tokens).index_add(0, token, results * route_weight.index_select(0, kept).unsqueeze(1));
  const at::Tensor counts = at::bincount(expert_id, {}, E), chosen = at::bincount(route_expert, {}, E);
  // A training forward: one that records a graph, or a checkpointed block's
  // first pass (its recompute, inside the backward, routes the same tokens again).
  const CheckpointPass pass = checkpoint_pass();
  const bool training = pass == CheckpointPass::kFirst || (at::GradMode::is_enabled() && pass == CheckpointPass::kNone);
  if (training) record(counts, N * k - kept.size(0), chosen, N);
  routing_ = {counts, N * k - kept.size(0),
              options.aux_loss_scope() == AuxLossScope::kGlobal ? global_balance_loss(probs, chosen)
                                                                 : balance_loss(probs, route_expert)};
  at::Tensor y = out.view(x.sizes());
  if (options.aux_loss_coef() > 0 && at::GradMode::is_enabled() && routing_.aux_loss.requires_grad())
    y = AttachAuxLoss::apply(y, routing_.aux_loss, options.aux_loss_coef() * aux_loss_scale);
  return y;
}

// Switch Transformer's balance: f_e over all routes chosen (dropped or not),
// P_e the mean probability; over the token group's tokens when there is one.
at::Tensor MoEImpl::balance_loss(const at::Tensor& probs, const at::Tensor& route_expert) {
  const int64_t E = options.experts(), N = probs.size(0);
  at::Tensor counts = at::cat({at::bincount(route_expert, {}, E), at::full({1}, N, route_expert.options())})
                          .to(at::kDouble);
  const int64_t members = token_members_;
  if (token_sum_) token_sum_(counts);
  const double tokens = counts[E].item<double>();
  const at::Tensor f = (counts.narrow(0, 0, E) / (tokens * options.top_k())).to(probs.scalar_type());
  return (f * probs.sum(0) / tokens).sum() * static_cast<double>(E * members);
}

// The global scope's piece of this forward (Note [Global-batch balance
// loss]): valued as the forward's own balance loss, its gradient from the
// step's statistics.
at::Tensor MoEImpl::global_balance_loss(const at::Tensor& probs, const at::Tensor& chosen) {
  const int64_t E = options.experts(), N = probs.size(0);
  const at::Tensor sums = probs.sum(0);
  at::Tensor own;
  {
    at::NoGradGuard no_grad;
    const at::Tensor f = chosen.to(probs.scalar_type()) / static_cast<double>(N * options.top_k());
    own = (f * sums / static_cast<double>(N)).sum() * static_cast<double>(E);
  }
  return deferred_balance_loss(sums, own, balance_, balance_slot_, options.top_k());
}

// What a training forward routed: the metrics' load, and the global scope's statistics.
void MoEImpl::record(const at::Tensor& computed, int64_t dropped, const at::Tensor& chosen, int64_t tokens) {
  load_.tokens_per_expert = load_.tokens_per_expert.defined() ? load_.tokens_per_expert + computed : computed;
  load_.dropped += dropped;
  if (options.aux_loss_scope() == AuxLossScope::kGlobal) balance_->add(balance_slot_, chosen, tokens);
}

MoELoad MoEImpl::take_load() {
  MoELoad out = load_;
  if (!out.tokens_per_expert.defined()) out.tokens_per_expert = at::zeros({options.experts()}, at::kLong);
  load_ = {};
  return out;
}

at::Tensor MoEImpl::run_experts(const at::Tensor& rows, const at::Tensor& expert_of_row) {
  at::Tensor out = at::zeros_like(rows);
  std::vector<at::Tensor> weights{w_in, w_up, w_out};
  const int ep = group_ ? group_->size() : 1;
  if (ep > 1 && at::GradMode::is_enabled())
    for (at::Tensor& w : weights)
      if (w.defined()) w = ScaleGradient::apply(w, 1.0 / ep);
  for (int64_t e = 0; e < w_in.size(0); ++e) {
    // Every expert runs, on no rows when none came, so each has a gradient
    // every step (DDP's buckets wait for every parameter).
    const at::Tensor picked = (expert_of_row == first_expert_ + e).nonzero().squeeze(1);
    out.index_add_(0, picked, expert(e, rows.index_select(0, picked), weights));
  }
  return out;
}

at::Tensor MoEImpl::run_experts_parallel(const at::Tensor& rows, const at::Tensor& expert_of_row) {
  const int64_t local = w_in.size(0);
  // Dispatch: routes grouped by the rank that holds their expert.
  const at::Tensor owner = at::div(expert_of_row, local, "floor");
  const at::Tensor order = std::get<1>(owner.sort(c10::optional<bool>(true), 0, /*descending=*/false));
  const at::Tensor counts = at::bincount(owner, {}, group_->size());
  const std::vector<int64_t> send(counts.data_ptr<int64_t>(), counts.data_ptr<int64_t>() + counts.numel());
  const nn::Exchanged received = group_->exchange(rows.index_select(0, order), send);
  at::Tensor received_ids;
  {
    at::NoGradGuard no_grad;  // ids: no gradient
    received_ids = group_->exchange(expert_of_row.index_select(0, order), send).rows;
  }
  // Compute, combine: the results go back in the order they were sent, then to their routes.
  const at::Tensor back = group_->exchange(run_experts(received.rows, received_ids), received.counts).rows;
  return at::zeros_like(back).index_copy(0, order, back);
}

}  // namespace models
}  // namespace meshtrain
