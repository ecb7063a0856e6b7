// A user's own Llama (examples/user_llama: plain torch layers and nn pieces,
// written for one process) given tensor, sequence and context parallelism,
// activation checkpointing and FSDP from outside by the example's own
// parallelize_llama trains like one process: every step's loss and every
// final weight (gathered over dp x cp and tp) against the same model trained
// whole, on layouts of 4 and 8 ranks. SGD with momentum, so that the weights
// must agree to float reassociation (Adam's eps would amplify it).

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "../../examples/user_llama/parallelize.h"
#include "harness.h"
#include "meshtrain/mesh.h"
#include "tp/shards.h"

using meshtrain::comm::CommPtr;
using meshtrain::comm::Communicator;
using meshtrain::testing::run_ranks;

namespace {

constexpr int kSteps = 4;
constexpr int64_t kBatch = 8;

struct Trained {
  std::vector<double> losses;
  std::map<std::string, torch::Tensor> params;  // whole
};

std::unique_ptr<torch::optim::SGD> sgd(torch::nn::Module& m) {
  return std::make_unique<torch::optim::SGD>(m.parameters(), torch::optim::SGDOptions(0.2).momentum(0.9));
}

Trained one_process(const user_llama::Config& c) {
  meshtrain::models::Stage model = user_llama::build(c);
  auto opt = sgd(*model);
  Trained r;
  for (int step = 0; step < kSteps; ++step) {
    const auto [x, y] = user_llama::batch(c, step, kBatch);
    opt->zero_grad();
    const torch::Tensor loss = user_llama::loss(model->forward(x), y, {});
    loss.backward();
    opt->step();
    r.losses.push_back(loss.item<double>());
  }
  for (const auto& kv : model->named_parameters()) r.params[kv.key()] = kv.value().detach().clone();
  return r;
}

struct Layout {
  int dp, tp, cp;
  bool sequence_parallel, checkpoint;
  std::string name() const {
    return "dp " + std::to_string(dp) + " x tp " + std::to_string(tp) + " x cp " + std::to_string(cp) +
           (sequence_parallel ? " sp" : "") + (checkpoint ? " checkpointed" : "");
  }
};

Trained on_mesh(const user_llama::Config& c, const Layout& l, Communicator& comm) {
  const CommPtr world(&comm, [](Communicator*) {});
  meshtrain::mesh::DeviceMesh mesh(world, meshtrain::mesh::MeshLayout(comm.size(), meshtrain::mesh::MeshDims().dp(l.dp).tp(l.tp).cp(l.cp)));
  user_llama::Parallel p;
  p.tp = mesh.tp();
  p.cp = mesh.cp();
  p.dp_cp = mesh.dp_cp();
  p.sequence_parallel = l.sequence_parallel;
  p.checkpoint = l.checkpoint;
  meshtrain::models::Stage model = user_llama::build(c);
  user_llama::parallelize(*model, c, p);
  auto opt = sgd(*model);
  Trained r;
  auto part = [&](const torch::Tensor& t) { return user_llama::my_part(t, l.dp, mesh.coord().dp, l.cp, mesh.coord().cp); };
  for (int step = 0; step < kSteps; ++step) {
    const auto [x, y] = user_llama::batch(c, step, kBatch);
    opt->zero_grad();
    const torch::Tensor loss = user_llama::loss(model->forward(part(x)), part(y), p);
    loss.backward();
    opt->step();
    torch::Tensor mean = loss.detach().reshape({1}).to(torch::kDouble);
    p.dp_cp->all_reduce(mean, meshtrain::comm::ReduceOp::kAvg);
    r.losses.push_back(mean.item<double>());
  }
  const auto over_dp = meshtrain::zero::full_parameters(*model);  // tp slices still cut
  r.params = meshtrain::tp::unshard(over_dp, meshtrain::tp::shard_dims(*model), *mesh.tp());
  return r;
}

void expect_trains_like_one_process(const Layout& l) {
  const user_llama::Config c;
  const Trained ref = one_process(c);
  run_ranks(l.dp * l.tp * l.cp, [&](Communicator& comm) {
    const Trained got = on_mesh(c, l, comm);
    const std::string where = l.name() + ", rank " + std::to_string(comm.rank());
    double loss_diff = 0, weight_diff = 0;
    for (int s = 0; s < kSteps; ++s) loss_diff = std::max(loss_diff, std::abs(got.losses[s] - ref.losses[s]));
    for (const auto& kv : got.params)
      if (ref.params.count(kv.first) && kv.second.sizes() == ref.params.at(kv.first).sizes())
        weight_diff = std::max(weight_diff, (kv.second - ref.params.at(kv.first)).abs().max().item<double>());
    if (comm.rank() == 0)
      std::printf("%s: max |loss diff| %g, max |weight diff| %g\n", l.name().c_str(), loss_diff, weight_diff);
    for (int s = 0; s < kSteps; ++s)
      EXPECT_NEAR(got.losses[s], ref.losses[s], 2e-6 * (1 + ref.losses[s])) << where << " step " << s;
    ASSERT_EQ(got.params.size(), ref.params.size()) << where;
    for (const auto& kv : ref.params) {
      ASSERT_TRUE(got.params.count(kv.first)) << where << ": no " << kv.first;
      EXPECT_TRUE(torch::allclose(got.params.at(kv.first), kv.second, 2e-4, 2e-5)) << where << " parameter " << kv.first;
    }
  });
}

TEST(UserLlama, TensorSequenceAndContextParallelFromOutsideTrainLikeOneProcess) {
  expect_trains_like_one_process({1, 2, 2, true, true});  // tp 2 with sp, cp 2, recomputed blocks
  expect_trains_like_one_process({2, 2, 1, true, false});  // FSDP over dp 2 of tp 2 slices
  expect_trains_like_one_process({2, 1, 2, false, true});  // FSDP over dp x cp = 4
}

TEST(UserLlama, EveryAxisAtOnceOnEightRanks) {
  expect_trains_like_one_process({2, 2, 2, true, true});
}

}  // namespace
