// The mixture-of-experts MLP: see the header for the math. Routes are
// grouped by expert (a stable sort), each expert runs once on its tokens,
// and the weighted outputs are added back at their tokens.
#include "meshtrain/models/moe.h"

#include <ATen/ATen.h>

#include <cmath>

#include "meshtrain/util/error.h"
#include "meshtrain/util/init.h"

namespace meshtrain {
namespace models {

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
  auto make = [&](const std::string& name, std::vector<int64_t> shape) {
    return register_parameter(name, init_full(o.seed(), o.name() + "." + name, normal, shape));
  };
  router = make("router", {E, H});
  w_in = make(o.swiglu() ? "gate" : "fc1", {E, F, H});
  if (o.swiglu()) w_up = make("up", {E, F, H});
  w_out = make(o.swiglu() ? "down" : "fc2", {E, H, F});
}

at::Tensor MoEImpl::expert(int64_t e, const at::Tensor& tokens) const {
  const at::Tensor inner = at::matmul(tokens, w_in[e].t());
  const at::Tensor act = options.swiglu() ? at::silu(inner) * at::matmul(tokens, w_up[e].t()) : at::gelu(inner);
  return at::matmul(act, w_out[e].t());
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
  const at::Tensor kept_expert = route_expert.index_select(0, kept);
  const at::Tensor by_expert = kept.index_select(0, std::get<1>(kept_expert.sort(c10::optional<bool>(true), 0, /*descending=*/false)));
  const at::Tensor counts = at::bincount(kept_expert, {}, E);
  at::Tensor out = at::zeros_like(tokens);
  int64_t first = 0;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t n = counts[e].item<int64_t>();
    if (n == 0) continue;
    const at::Tensor routes = by_expert.narrow(0, first, n), token = route_token.index_select(0, routes);
    out.index_add_(0, token, expert(e, tokens.index_select(0, token)) * route_weight.index_select(0, routes).unsqueeze(1));
    first += n;
  }
  // Switch Transformer's balance: f_e over all N k routes chosen (dropped or not), P_e the mean probability.
  const at::Tensor f = at::bincount(route_expert, {}, E).to(stats) / static_cast<double>(N * k);
  routing_ = {counts, N * k - kept.size(0), (f * probs.mean(0)).sum() * static_cast<double>(E)};
  return out.view(x.sizes());
}

}  // namespace models
}  // namespace meshtrain
