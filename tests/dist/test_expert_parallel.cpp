// Expert parallelism (models::MoE spread by ep::parallelize, ep/all_to_all.h) on ep
// 2, 3 and 4 ranks, each rank with its own tokens (a different number on
// each): every rank's output, its routing, its input's and router's
// gradients equal one process's MoE on the same tokens with every expert,
// and each rank's expert gradients equal its slice of the mean over ranks of
// the one-process gradients (the routes its experts computed came from every
// rank; the mean, as a data-parallel gradient). The experts are held apart
// from the module's parameters. fp64, so anything beyond reassociation shows.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "harness.h"
#include "ep/all_to_all.h"
#include "meshtrain/ep.h"
#include "meshtrain/moe.h"

using meshtrain::comm::Communicator;
using meshtrain::models::MoE;
using meshtrain::models::MoEOptions;
using meshtrain::testing::run_ranks;

namespace {

double max_error(const torch::Tensor& a, const torch::Tensor& b) {
  return a.numel() == 0 ? 0.0 : (a - b).abs().max().item<double>();
}

void expert_parallel_matches_one_process(Communicator& plain, double capacity_factor) {
  auto comm = std::shared_ptr<Communicator>(&plain, [](Communicator*) {});
  const int n = comm->size(), r = comm->rank();
  const int64_t H = 8, F = 12, E = 2 * n, N = 17 + 3 * r;
  MoE whole(MoEOptions(H, F, E, 2).capacity_factor(capacity_factor));
  MoE mine(MoEOptions(H, F, E, 2).capacity_factor(capacity_factor));
  EXPECT_EQ(meshtrain::ep::parallelize(*mine, comm), 1);  // this rank's slice of the experts
  whole->to(torch::kDouble);
  mine->to(torch::kDouble);
  torch::manual_seed(100 + r);
  const torch::Tensor x = (torch::randn({N, H}, torch::kDouble) * 4).requires_grad_();
  const torch::Tensor dout = torch::randn({N, H}, torch::kDouble);
  const torch::Tensor x2 = x.detach().clone().requires_grad_();
  const torch::Tensor want = whole->forward(x), got = mine->forward(x2);
  ((want * dout).sum() + 0.1 * whole->aux_loss()).backward();
  ((got * dout).sum() + 0.1 * mine->aux_loss()).backward();
  const std::string where = "ep " + std::to_string(n) + " rank " + std::to_string(r);
  EXPECT_LE(max_error(got, want), 1e-12) << where << ": output";
  EXPECT_TRUE(torch::equal(mine->routing().tokens_per_expert, whole->routing().tokens_per_expert)) << where;
  EXPECT_EQ(mine->routing().dropped, whole->routing().dropped) << where;
  EXPECT_LE(max_error(x2.grad(), x.grad()), 1e-12) << where << ": input gradient";
  EXPECT_LE(max_error(mine->router.grad(), whole->router.grad()), 1e-12) << where << ": router gradient";
  const meshtrain::ep::ExpertSlice slice = meshtrain::ep::expert_slice(E, n, r);
  for (auto [got_w, want_w] : {std::pair{mine->w_in, whole->w_in}, {mine->w_up, whole->w_up}, {mine->w_out, whole->w_out}}) {
    torch::Tensor sum = want_w.grad().clone();
    comm->all_reduce(sum);
    EXPECT_LE(max_error(got_w.grad(), sum.narrow(0, slice.first, slice.count) / n), 1e-12) << where << ": expert gradient";
  }
  EXPECT_EQ(mine->expert_parameters().size(), 3u) << where;  // gate, up, down: held apart, converted by to()
  EXPECT_EQ(mine->parameters().size(), 1u) << where;         // the router
  EXPECT_EQ(mine->w_in.scalar_type(), torch::kDouble) << where;
}

TEST(ExpertParallel, EveryRankLikeOneProcessWithItsSliceOfExperts) {
  for (int n : {2, 3, 4}) run_ranks(n, [](Communicator& c) { expert_parallel_matches_one_process(c, 0); });
  run_ranks(2, [](Communicator& c) { expert_parallel_matches_one_process(c, 0.75); });  // with drops
}

TEST(ExpertParallel, EpThatDoesNotDivideTheExpertsIsRefused) {
  try {
    meshtrain::ep::expert_slice(8, 3, 0);
    FAIL() << "ep 3 accepted for 8 experts";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("--ep 3 does not divide --experts 8"), std::string::npos) << e.what();
  }
}

}  // namespace
