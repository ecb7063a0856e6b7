// Mixtures of experts on the trainer's mesh (--experts, --top-k,
// --capacity-factor, --ep): every block's MLP is a models::MoE; the balance
// loss joins each micro-batch's backward on whichever pipeline stage the
// layer runs; under --ep the experts are split over ranks of dp x cp, tokens
// reach them by all-to-all, and their gradients are averaged over the ranks
// holding the same experts. Every layout trains like one process running the
// global batch at once (the balance loss covers the step's whole batch, the
// default --aux-loss-scope global; test_moe_matrix.cpp runs the layouts at the
// default coefficient), dropless and with drops (against one process whose
// micro-batches are the ranks': a capacity drops routes per forward), and the
// metrics' router load equals one process's, route for route.
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <sstream>

#include "equivalence.h"
#include "meshtrain/comm.h"
#include "meshtrain/moe.h"
#include "meshtrain/train.h"
#include "../unit/config_error.h"
#include "app/commands/export.h"
#include "app/trainer/run_training.h"

namespace meshtrain {
namespace testing {
namespace {

train::TrainConfig with_experts(train::TrainConfig c, int64_t experts, int ep = 1) {
  c.model.experts = experts;
  c.model.top_k = 2;
  c.model.aux_loss_coef = 0.05;  // large enough to move the router in 4 steps
  c.ep = ep;
  return c;
}

TEST(Experts, DataParallelZero3WithRecomputedBlocks) {
  train::TrainConfig c = with_experts(tiny_llama(), 4);
  c.dp = 2;
  c.zero = 3;
  c.activation_checkpointing = "blocks";
  expect_trains_like_one_process(c, 2);
}

TEST(Experts, ExpertParallelOverDataParallel) {
  train::TrainConfig c = with_experts(tiny_llama(), 4, 2);
  expect_trains_like_one_process(c, 2);  // ep 2 = dp 2
  c.zero = 1;
  expect_trains_like_one_process(c, 4);  // ep 2 within dp 4: two replicas of each expert
  c.zero = 3;  // the rest fully sharded, the experts ZeRO-2 over their replicas, recomputed blocks
  c.activation_checkpointing = "blocks";
  expect_trains_like_one_process(c, 4);
  c.ep = 4;
  c.zero = 0;
  c.activation_checkpointing = "none";
  expect_trains_like_one_process(c, 4);  // ep 4 = dp 4: one expert per rank
  train::TrainConfig g = with_experts(tiny_gpt(), 6, 3);  // GELU experts, odd ep
  expect_trains_like_one_process(g, 3);
}

TEST(Experts, BalanceLossOnEveryPipelineStage) {
  train::TrainConfig c = with_experts(tiny_gpt(), 4, 2);
  c.pp = 2;
  c.microbatches = 2;  // per rank: micro-batches of 6 samples, GPipe (the global scope's default)
  expect_trains_like_one_process(c, 4);
  c.ep = 4;  // dp 4 x pp 2: micro-batches of 3
  expect_trains_like_one_process(c, 8);
}

TEST(Experts, WithTensorAndContextParallelism) {
  train::TrainConfig t = with_experts(tiny_llama(), 4, 2);
  t.tp = 2;  // the experts whole on both tp ranks, split over ep 2 of dp 2
  expect_trains_like_one_process(t, 4);
  train::TrainConfig c = with_experts(tiny_llama(), 4, 2);
  c.cp = 2;  // ep over the 2 ranks of dp 1 x cp 2; the balance statistics over the whole sequences
  expect_trains_like_one_process(c, 2);
}

TEST(Experts, CapacityDropsLikeOneProcess) {
  train::TrainConfig c = with_experts(tiny_llama(), 4, 2);
  c.model.capacity_factor = 1.0;  // capacity per forward: one process forwards the ranks' micro-batches
  expect_trains_like_one_process(c, 2, {}, RankOptions(), /*reference_micro_batch=*/12);
}

// Checkpoints hold each expert tensor whole (each ep rank writes its slice):
// a run saved under ep 2 resumes under ep 1 with ZeRO-3, and one saved under
// ep 1 with ZeRO-1 resumes under ep 2, both as if never stopped.
TEST(Experts, CheckpointsResumeUnderAnotherEp) {
  const train::TrainConfig base = with_experts(tiny_llama(), 4);
  train::TrainConfig one = base;
  one.steps = 6;
  const TrainOutput reference = in_rank_process() ? TrainOutput{} : train_in_one_process(one);
  for (const auto& [from_ep, from_zero, to_ep, to_zero] : {std::array<int, 4>{2, 0, 1, 3}, {1, 1, 2, 0}}) {
    train::TrainConfig from = base, to = base;
    from.dp = to.dp = 2;
    from.ep = from_ep;
    from.zero = from_zero;
    to.ep = to_ep;
    to.zero = to_zero;
    from.save_dir = to.save_dir = checkpoint_dir("experts-ep" + std::to_string(from_ep));
    from.steps = from.save_every = 3;
    to.steps = 6;
    to.save_every = 3;  // and the end, which generate reads below
    to.resume = true;
    train_on_ranks(from, 2);
    const TrainOutput got = train_on_ranks(to, 2);
    if (in_rank_process()) continue;
    EXPECT_EQ(got.first_step, 3);
    expect_same_training(got, reference, Tolerance{}, "ep " + std::to_string(from_ep) + " -> " + std::to_string(to_ep));
    // What generate reads from the checkpoint: the mixture, every expert whole, the trained values.
    const train::CheckpointModel saved = train::load_checkpoint_model(to.save_dir);
    EXPECT_EQ(saved.config.experts, 4);
    EXPECT_EQ(saved.config.top_k, 2);
    ASSERT_TRUE(saved.parameters.count("blocks.1.moe.gate"));
    EXPECT_TRUE(at::equal(saved.parameters.at("blocks.1.moe.gate"), got.parameters.at("blocks.1.moe.gate")));
    std::ostringstream out;
    const std::string refused = config_error_of(
        [&] { train::run_export_command({"--resume", to.save_dir, "--out", to.save_dir + "/hf"}, out); });
    EXPECT_NE(refused.find("mixture of experts (--experts 4)"), std::string::npos) << refused;
  }
}

// Routes per layer and expert over the global batch: each layer's routes and
// drops add to tokens x top-k, and equal one process's exactly; the ep axis
// carries dispatch and combine.
TEST(Experts, MetricsRouterLoadEqualsOneProcess) {
  train::TrainConfig c = with_experts(tiny_llama(), 4, 2);
  c.model.capacity_factor = 1.0;
  c.pp = 2;
  c.microbatches = 2;
  const json::Value m = metrics_on_ranks(c, 4);
  if (m.type == json::Value::Type::kNull) return;  // in a rank process
  train::RunOptions quiet;
  quiet.verbose = false;
  quiet.evaluate = false;
  const train::TrainResult ref =
      train::run_training(train::resolve(one_process(c, 6), 1), comm::make_single_process_world(), quiet);
  const json::Value& loads = m["experts"]["router_load"];
  ASSERT_EQ(loads.items.size(), ref.router_load.size());
  double dropped = 0;
  for (size_t s = 0; s < ref.router_load.size(); ++s) {
    const at::Tensor& want = ref.router_load[s];
    dropped += want.select(1, -1).sum().item<double>();
    for (int64_t l = 0; l < c.model.layers; ++l) {
      EXPECT_EQ(want[l].sum().item<double>(), 24.0 * 16 * 2) << "step " << s << " layer " << l;
      for (int64_t e = 0; e < c.model.experts; ++e)
        EXPECT_EQ(loads.items[s].items[l].items[e].number, want[l][e].item<double>()) << "step " << s << " layer " << l;
    }
    EXPECT_EQ(m["experts"]["moe_dropped"].items[s].number, want.select(1, -1).sum().item<double>());
  }
  EXPECT_GT(dropped, 0);  // capacity 1.0 drops some routes of an unbalanced router
  for (const auto& rank : m["ranks"].items) EXPECT_GT(rank["traffic_by_axis"]["ep"]["total"]["bytes_sent"].number, 0);
  EXPECT_EQ(m["config"]["ep"].number, 2);
}

// A user's train::Trainer over a Sequential whose second pipeline stage is
// a mixture of experts with a balance loss: under the global scope (the
// default) a schedule that runs a backward before the step's last forward is
// refused on both stages (the first holds no expert), naming both ways out;
// GPipe, and the micro scope under 1F1B, train.
TEST(Experts, TheTrainerRefusesAScheduleRunningABackwardBeforeTheLastForward) {
  run_ranks(2, [](comm::Communicator& comm) {
    auto self = std::shared_ptr<comm::Communicator>(&comm, [](comm::Communicator*) {});
    const mesh::DeviceMesh mesh(self, mesh::MeshLayout(2, mesh::MeshDims().dp(1).pp(2)));
    auto model = [] {
      at::manual_seed(1);
      return torch::nn::Sequential(torch::nn::Linear(8, 8),
                                   models::MoE(models::MoEOptions(8, 16, 4, 2).aux_loss_coef(0.01)));
    };
    auto loss = [](const at::Tensor& y, const at::Tensor& t) { return (y - t).pow(2).mean(); };
    auto sgd = [](std::vector<at::Tensor> p) { return std::make_unique<torch::optim::SGD>(p, 0.1); };
    auto options = [](const std::string& schedule) {
      return train::TrainerOptions().pipeline(pp::PipelineOptions().schedule(schedule).microbatches(4));
    };
    try {
      train::Trainer refused(model(), mesh, loss, sgd, options("1f1b"));
      ADD_FAILURE() << "1f1b accepted on rank " << comm.rank();
    } catch (const ConfigError& e) {
      const std::string what = e.what();
      for (const char* part : {"mixture of experts 'moe'", "schedule 1f1b with 4 micro-batches", "schedule gpipe",
                               "--aux-loss-scope micro"})
        EXPECT_NE(what.find(part), std::string::npos) << "rank " << comm.rank() << ": " << what;
    }
    const at::Tensor x = at::randn({8, 8});
    train::Trainer gpipe(model(), mesh, loss, sgd, options("gpipe"));
    EXPECT_TRUE(std::isfinite(gpipe.step(x, x)));
    train::Trainer micro(model(), mesh, loss, sgd, options("1f1b").aux_loss_scope(models::AuxLossScope::kMicro));
    EXPECT_TRUE(std::isfinite(micro.step(x, x)));
  });
}

}  // namespace
}  // namespace testing
}  // namespace meshtrain
