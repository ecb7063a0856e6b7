// The mixture-of-experts MLP (models/moe.h) against a token-by-token
// reference written from the definition (each token's softmax, its top-k,
// the renormalised weights, the chosen experts' MLPs), forward and gradients,
// dropless and with a capacity; the load-balancing loss at its two ends.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <torch/autograd.h>

#include <vector>

#include "meshtrain/models/moe.h"

namespace meshtrain {
namespace models {
namespace {

// One expert on one token, from the module's weights: [H] -> [H].
at::Tensor reference_expert(const MoEImpl& m, int64_t e, const at::Tensor& t) {
  const at::Tensor inner = at::mv(m.w_in[e], t);
  const at::Tensor act = m.options.swiglu() ? at::silu(inner) * at::mv(m.w_up[e], t) : at::gelu(inner);
  return at::mv(m.w_out[e], act);
}

struct Reference {
  at::Tensor out, aux;
  std::vector<int64_t> per_expert;
  int64_t dropped = 0;
};

// Token by token; routes considered in the same order as the module's
// (token 0's choices, then token 1's, ...) against each expert's capacity.
Reference reference_moe(const MoEImpl& m, const at::Tensor& x) {
  const int64_t E = m.options.experts(), k = m.options.top_k(), N = x.size(0);
  const int64_t capacity = m.options.capacity_factor() > 0
                               ? static_cast<int64_t>(std::ceil(m.options.capacity_factor() * N * k / E))
                               : N * k;
  Reference r;
  r.per_expert.assign(E, 0);
  std::vector<int64_t> chosen(E, 0);
  std::vector<at::Tensor> rows;
  at::Tensor prob_sum = at::zeros({E}, x.options());
  for (int64_t n = 0; n < N; ++n) {
    const at::Tensor p = at::softmax(at::mv(m.router, x[n]), 0);
    prob_sum = prob_sum + p;
    const at::Tensor order = std::get<1>(p.sort(0, /*descending=*/true));
    at::Tensor total = at::zeros({k}, x.options()).sum(), y = at::zeros_like(x[n]);
    for (int64_t j = 0; j < k; ++j) total = total + p[order[j].item<int64_t>()];
    for (int64_t j = 0; j < k; ++j) {
      const int64_t e = order[j].item<int64_t>();
      ++chosen[e];
      if (r.per_expert[e] == capacity) {
        ++r.dropped;
        continue;
      }
      ++r.per_expert[e];
      y = y + p[e] / total * reference_expert(m, e, x[n]);
    }
    rows.push_back(y);
  }
  r.out = at::stack(rows);
  at::Tensor aux = at::zeros({}, x.options());
  for (int64_t e = 0; e < E; ++e) aux = aux + static_cast<double>(chosen[e]) / (N * k) * prob_sum[e] / N;
  r.aux = aux * static_cast<double>(E);
  return r;
}

struct Grads {
  std::vector<at::Tensor> of;  // x, then every parameter
};

Grads grads_of(MoEImpl& m, const at::Tensor& x, const at::Tensor& loss) {
  std::vector<at::Tensor> inputs = {x};
  for (const at::Tensor& p : m.parameters()) inputs.push_back(p);
  return {torch::autograd::grad({loss}, inputs)};
}

// Returns the routes dropped.
int64_t expect_matches_reference(const MoEOptions& options, const std::string& what) {
  MoE m(options);
  m->to(at::kDouble);
  at::manual_seed(9);
  const int64_t N = 23;
  const at::Tensor x = at::randn({N, options.hidden()}, at::kDouble).mul_(8).requires_grad_();
  const at::Tensor dout = at::randn({N, options.hidden()}, at::kDouble);
  const at::Tensor got = m->forward(x);
  const Reference want = reference_moe(*m, x);
  EXPECT_LE((got - want.out).abs().max().item<double>(), 1e-12) << what;
  EXPECT_NEAR(m->aux_loss().item<double>(), want.aux.item<double>(), 1e-12) << what;
  EXPECT_EQ(m->routing().dropped, want.dropped) << what;
  for (int64_t e = 0; e < options.experts(); ++e)
    EXPECT_EQ(m->routing().tokens_per_expert[e].item<int64_t>(), want.per_expert[e]) << what << " expert " << e;
  const Grads g = grads_of(*m, x, (got * dout).sum() + 0.1 * m->aux_loss());
  const Grads r = grads_of(*m, x, (want.out * dout).sum() + 0.1 * want.aux);
  for (size_t i = 0; i < g.of.size(); ++i)
    EXPECT_LE((g.of[i] - r.of[i]).abs().max().item<double>(), 1e-12) << what << " gradient " << i;
  return want.dropped;
}

TEST(MoE, DroplessTopKMatchesTheTokenByTokenDefinition) {
  EXPECT_EQ(expect_matches_reference(MoEOptions(8, 12, 8, 2), "swiglu, 8 experts, top-2"), 0);
  expect_matches_reference(MoEOptions(8, 12, 5, 3).swiglu(false), "gelu, 5 experts, top-3");
  expect_matches_reference(MoEOptions(8, 12, 4, 1), "top-1 (Switch)");
}

TEST(MoE, CapacityDropsTheLaterRoutesOfFullExperts) {
  // Capacity ceil(0.5 * 23 * 2 / 4) = 6 routes per expert: about half are dropped.
  EXPECT_GT(expect_matches_reference(MoEOptions(8, 12, 4, 2).capacity_factor(0.5), "capacity factor 0.5"), 15);
  // By hand: experts of six routes [0, 1, 0, 0, 2, 0], capacity 2.
  const at::Tensor keep = routes_within_capacity(at::tensor({0, 1, 0, 0, 2, 0}, at::kLong), 3, 2);
  EXPECT_TRUE(at::equal(keep.to(at::kLong), at::tensor({1, 1, 1, 0, 1, 0}, at::kLong)));
  EXPECT_EQ(expert_capacity(1.25, 10, 2, 4), 7);  // ceil(6.25)
  EXPECT_EQ(expert_capacity(0, 10, 2, 4), -1);
}

TEST(MoE, BalanceLossIsOneWhenUniformAndExpertsOverTopKWhenCollapsed) {
  MoE m(MoEOptions(4, 8, 8, 2));
  const at::Tensor x = at::randn({50, 4});
  {
    at::NoGradGuard no_grad;
    m->router.zero_();  // every probability 1/E: f sums to 1, so E sum f_e / E = 1
  }
  m->forward(x);
  EXPECT_NEAR(m->aux_loss().item<double>(), 1.0, 1e-6);
  {
    at::NoGradGuard no_grad;  // experts 0 and 1 take every token with probability ~1/2 each
    m->router.zero_();
    m->router[0].fill_(50);
    m->router[1].fill_(50);
  }
  m->forward(x.abs() + 0.1);
  EXPECT_NEAR(m->aux_loss().item<double>(), 8.0 / 2, 1e-3);
  EXPECT_EQ(m->routing().tokens_per_expert[0].item<int64_t>(), 50);
  EXPECT_EQ(m->routing().tokens_per_expert[1].item<int64_t>(), 50);
  EXPECT_THROW(MoE(MoEOptions(4, 8, 2, 3)), std::invalid_argument);  // top-3 of 2 experts
}

// aux_loss_coef attaches the balance loss to the output's backward: the
// gradients equal those of (output . dout) + coef x scale x aux_loss(), the
// output is unchanged, and a forward without a graph records no load.
TEST(MoE, BalanceLossJoinsTheBackwardWithItsCoefficientAndScale) {
  at::manual_seed(3);
  const at::Tensor x = at::randn({2, 9, 8}, at::kDouble), dout = at::randn({2, 9, 8}, at::kDouble);
  MoE manual(MoEOptions(8, 12, 4, 2)), attached(MoEOptions(8, 12, 4, 2).aux_loss_coef(0.3));
  manual->to(at::kDouble);
  attached->to(at::kDouble);
  attached->aux_loss_scale = 0.25;  // what train::Trainer sets for 4 micro-batches
  const at::Tensor want = manual->forward(x), got = attached->forward(x);
  EXPECT_TRUE(at::equal(got, want));
  ((want * dout).sum() + 0.3 * 0.25 * manual->aux_loss()).backward();
  (got * dout).sum().backward();
  for (const auto& p : manual->named_parameters()) {
    const at::Tensor g = attached->named_parameters()[p.key()].grad();
    EXPECT_LE((g - p.value().grad()).abs().max().item<double>(), 1e-12) << p.key();
  }
  EXPECT_GT(attached->router.grad().abs().sum().item<double>(), 0);
  MoELoad load = attached->take_load();
  EXPECT_EQ(load.tokens_per_expert.sum().item<int64_t>(), 2 * 9 * 2);  // N k routes, dropless
  {
    at::NoGradGuard no_grad;  // evaluation, or a recompute's first pass
    attached->forward(x);
  }
  EXPECT_EQ(attached->take_load().tokens_per_expert.sum().item<int64_t>(), 0);
}

}  // namespace
}  // namespace models
}  // namespace meshtrain
