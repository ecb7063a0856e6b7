// The mixture-of-experts MLP (meshtrain/moe.h) against a token-by-token
// reference written from the definition (each token's softmax, its top-k,
// the renormalised weights, the chosen experts' MLPs), forward and gradients,
// dropless and with a capacity; the load-balancing loss at its two ends; the
// global-batch balance loss (moe_balance.h) against the loss of the whole
// batch computed at once, across micro-batches, ranks and recomputation.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <torch/autograd.h>

#include <vector>

#include "meshtrain/models.h"
#include "meshtrain/moe.h"
#include "meshtrain/util.h"

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
  MoE manual(MoEOptions(8, 12, 4, 2).aux_loss_scope(AuxLossScope::kMicro)),
      attached(MoEOptions(8, 12, 4, 2).aux_loss_coef(0.3).aux_loss_scope(AuxLossScope::kMicro));
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

// Routes per expert of tokens' probabilities [N, E]: each token's top-k.
at::Tensor chosen_counts(const at::Tensor& probs, int64_t top_k) {
  return at::bincount(std::get<1>(probs.detach().topk(top_k, -1)).reshape(-1), {}, probs.size(1));
}

// Switch Transformer's balance loss of a batch, written out: E sum_e f_e P_e
// with f from each token's top-k (no gradient), P the mean probability.
at::Tensor whole_batch_balance_loss(const at::Tensor& probs, int64_t top_k) {
  const int64_t N = probs.size(0), E = probs.size(1);
  const at::Tensor chosen = chosen_counts(probs, top_k);
  const at::Tensor f = chosen.to(probs.scalar_type()) / static_cast<double>(N * top_k);
  return (f * probs.mean(0)).sum() * static_cast<double>(E);
}

// Tokens' router logits, split as a layout would: two ranks of a token group,
// micro-batches of unequal size. Each rank's pieces of the deferred loss give
// its tokens `members` times the whole batch's gradient, which the data-
// parallel average over the two ranks brings back to exactly it; each piece
// is valued as its own tokens' loss, and the group's sums are taken once.
TEST(BalanceStatistics, DeferredLossGivesTheWholeBatchGradient) {
  const int64_t E = 5, k = 2;
  at::manual_seed(11);
  const at::Tensor logits = (at::randn({23, E}, at::kDouble) * 2).requires_grad_();
  const std::vector<std::vector<int64_t>> ranks = {{6, 4}, {9, 3, 1}};  // tokens per micro-batch
  at::Tensor want = whole_batch_balance_loss(at::softmax(logits, -1), k);
  const at::Tensor want_grad = torch::autograd::grad({want}, {logits})[0];
  // Each rank's statistics as it adds them; the group's sum is the two ranks' together.
  std::vector<at::Tensor> sums(2);
  int64_t first = 0;
  std::vector<std::vector<at::Tensor>> pieces_of(2);
  std::vector<std::vector<std::pair<int64_t, int64_t>>> spans(2);
  for (int r = 0; r < 2; ++r)
    for (int64_t n : ranks[r]) {
      spans[r].push_back({first, n});
      first += n;
    }
  for (int r = 0; r < 2; ++r) {
    sums[r] = at::zeros({E + 1}, at::kDouble);
    for (const auto& span : spans[r]) {
      const at::Tensor p = at::softmax(logits.narrow(0, span.first, span.second), -1).detach();
      sums[r].narrow(0, 0, E).add_(chosen_counts(p, k).to(at::kDouble));
      sums[r][E] += static_cast<double>(span.second);
    }
  }
  at::Tensor averaged = at::zeros_like(logits);
  for (int r = 0; r < 2; ++r) {
    int reductions = 0;
    const at::Tensor others = sums[1 - r];
    auto statistics = std::make_shared<BalanceStatistics>(
        [&reductions, others](at::Tensor& t) {
          ++reductions;
          t += others;
        },
        2);
    const int64_t slot = statistics->add_layer(E);
    statistics->begin_step();
    at::Tensor rank_loss = at::zeros({}, at::kDouble);
    for (const auto& span : spans[r]) {  // the forwards
      const at::Tensor probs = at::softmax(logits.narrow(0, span.first, span.second), -1);
      statistics->add(slot, chosen_counts(probs, k), span.second);
      const at::Tensor piece = deferred_balance_loss(probs.sum(0), whole_batch_balance_loss(probs, k).detach(),
                                                     statistics, slot, k);
      EXPECT_NEAR(piece.item<double>(), whole_batch_balance_loss(probs, k).item<double>(), 1e-15);
      rank_loss = rank_loss + piece;
    }
    averaged += torch::autograd::grad({rank_loss}, {logits})[0] / 2;
    EXPECT_EQ(reductions, 1) << "rank " << r;
    EXPECT_TRUE(at::equal(statistics->totals(slot), sums[0] + sums[1])) << "rank " << r;
  }
  EXPECT_LE((averaged - want_grad).abs().max().item<double>(), 1e-13);
  EXPECT_GT(want_grad.abs().max().item<double>(), 1e-3);
}

// Within a step the trainer opened, a forward after a backward read the
// step's counts is refused (its tokens would miss the f already used);
// without begin_step it starts the next step.
TEST(BalanceStatistics, AForwardAfterTheCountsWereReadIsRefusedWithinAStep) {
  BalanceStatistics alone;
  const int64_t slot = alone.add_layer(2);
  alone.add(slot, at::tensor({3, 1}), 2);
  alone.totals(slot);
  alone.add(slot, at::tensor({0, 2}), 1);  // the next step
  EXPECT_TRUE(at::equal(alone.totals(slot), at::tensor({0.0, 2.0, 1.0}, at::kDouble)));
  alone.begin_step();
  alone.add(slot, at::tensor({3, 1}), 2);
  alone.totals(slot);
  try {
    alone.add(slot, at::tensor({3, 1}), 2);
    FAIL() << "a forward after the read was accepted";
  } catch (const ConfigError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("--schedule gpipe"), std::string::npos) << what;
    EXPECT_NE(what.find("--aux-loss-scope micro"), std::string::npos) << what;
  }
  EXPECT_THROW(parse_aux_loss_scope("batch"), ConfigError);
  EXPECT_EQ(parse_aux_loss_scope("micro"), AuxLossScope::kMicro);
}

// The layer: two micro-batches' forwards, then their backwards, under the
// global scope give the gradients of the whole batch in one forward; under
// the micro scope (each micro-batch's loss, scaled by 1/2) they do not.
TEST(MoE, GlobalScopeMicroBatchesTrainLikeTheWholeBatch) {
  at::manual_seed(5);
  const at::Tensor x = at::randn({2, 9, 8}, at::kDouble) * 4, dout = at::randn({2, 9, 8}, at::kDouble);
  const MoEOptions options = MoEOptions(8, 12, 4, 2).aux_loss_coef(0.3);
  auto grads = [&](AuxLossScope scope, bool split) {
    MoE m(MoEOptions(options).aux_loss_scope(scope));
    m->to(at::kDouble);
    if (!split) {
      (m->forward(x) * dout).sum().backward();
    } else {
      m->aux_loss_scale = scope == AuxLossScope::kMicro ? 0.5 : 1.0;  // as train::Trainer sets them
      std::vector<at::Tensor> losses;
      for (int64_t j = 0; j < 2; ++j) losses.push_back((m->forward(x[j]) * dout[j]).sum());
      for (const at::Tensor& l : losses) l.backward();
    }
    return m->router.grad().clone();
  };
  const at::Tensor whole = grads(AuxLossScope::kGlobal, false);
  EXPECT_LE((grads(AuxLossScope::kGlobal, true) - whole).abs().max().item<double>(), 1e-12);
  EXPECT_GT((grads(AuxLossScope::kMicro, true) - whole).abs().max().item<double>(), 1e-6);
}

// Activation checkpointing runs a block's forward without a graph, then again
// in backward: the layer counts the first pass (in the step's order of
// forwards) and not the recompute, so the statistics and the metrics' load
// hold each token once, and the gradients are those without recomputation;
// also for a checkpointed block inside another (its first pass, run within
// the outer recompute, is a recompute too).
TEST(MoE, RecomputedForwardsCountEachTokenOnce) {
  at::manual_seed(6);
  const at::Tensor x = at::randn({2, 7, 8}, at::kDouble) * 4, dout = at::randn({2, 7, 8}, at::kDouble);
  const MoEOptions options = MoEOptions(8, 12, 4, 2).aux_loss_coef(0.3);
  enum Recompute { kNo, kOnce, kNested };
  auto run = [&](Recompute recompute) {
    MoE m(options);
    m->to(at::kDouble);
    auto block = [&](const at::Tensor& h) {
      if (recompute == kNo) return m->forward(h);
      if (recompute == kOnce) return checkpoint(m, h);
      return checkpoint([&m](const at::Tensor& g) { return checkpoint(m, g); }, h, m->parameters());
    };
    std::vector<at::Tensor> losses;
    for (int64_t j = 0; j < 2; ++j) losses.push_back((block(x[j].clone().requires_grad_()) * dout[j]).sum());
    for (const at::Tensor& l : losses) l.backward();
    EXPECT_EQ(m->balance_statistics()->totals(0)[4].item<double>(), 14) << "recompute " << recompute;
    EXPECT_EQ(m->take_load().tokens_per_expert.sum().item<int64_t>(), 14 * 2) << "recompute " << recompute;
    return m->router.grad().clone();
  };
  const at::Tensor kept = run(kNo);
  EXPECT_LE((run(kOnce) - kept).abs().max().item<double>(), 1e-12);
  EXPECT_LE((run(kNested) - kept).abs().max().item<double>(), 1e-12);
}

}  // namespace
}  // namespace models
}  // namespace meshtrain
