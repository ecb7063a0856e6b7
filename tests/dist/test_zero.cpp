// ZeRO stages 1-3: the central equivalence with one process, parameter groups,
// uneven shards, consolidated state loaded at another world size, and the
// paper's memory and traffic models.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "equivalence.h"
#include "harness.h"
#include "meshtrain/comm.h"
#include "meshtrain/dp.h"
#include "meshtrain/train.h"
#include "app/trainer/run_training.h"
#include "util/tensor_io.h"
#include "meshtrain/util.h"
#include "meshtrain/zero.h"


using meshtrain::comm::Communicator;
using meshtrain::testing::expect_trains_like_one_process;
using meshtrain::testing::run_ranks;
using meshtrain::testing::tiny_gpt;
using meshtrain::testing::tiny_mlp;
namespace zero = meshtrain::zero;

namespace {

struct Case {
  int stage;
  int world;
  std::string optimizer;
  bool accumulate;
};

class ZeroEquivalence : public ::testing::TestWithParam<Case> {};

TEST_P(ZeroEquivalence, GptMatchesOneProcess) {
  const Case& p = GetParam();
  auto c = tiny_gpt();
  c.zero = p.stage;
  c.optimizer = p.optimizer;
  if (p.optimizer == "sgd") c.momentum = 0.9;
  // Decoupled decay for AdamW. Not Adam's L2 decay: it adds wd * w to the
  // gradient of the attention's key bias, whose true gradient is exactly 0
  // (softmax ignores a shift shared by all keys), and Adam then normalizes
  // that bias's float noise to steps of +-lr whose signs depend on the order
  // of summation, on any layout, one process included.
  c.weight_decay = p.optimizer == "adamw" ? 0.1 : 0.0;
  c.bucket_cap_mb = 0.01;  // several buckets
  if (p.accumulate) c.micro_batch = c.global_batch / p.world / 2;
  expect_trains_like_one_process(c, p.world);
}

std::vector<Case> cases() {
  std::vector<Case> out;
  for (int s : {1, 2, 3})
    for (int w : {2, 3, 4})
      for (const char* o : {"sgd", "adamw"})
        for (bool a : {false, true}) out.push_back({s, w, o, a});
  for (int s : {0, 1, 2, 3}) out.push_back({s, 3, "adam", false});
  return out;
}

INSTANTIATE_TEST_SUITE_P(Stages, ZeroEquivalence, ::testing::ValuesIn(cases()), [](const auto& info) {
  const Case& c = info.param;
  return "zero" + std::to_string(c.stage) + "_world" + std::to_string(c.world) + "_" + c.optimizer +
         (c.accumulate ? "_accum" : "");
});

TEST(Zero, UnevenShardsOnAnOddSizedMlp) {
  for (int stage : {1, 2, 3}) {
    auto c = tiny_mlp();
    c.model.features = 7;
    c.model.hidden = 13;
    c.model.classes = 5;  // 7*13+13 + 13*13+13 + ... : no world size divides it
    c.zero = stage;
    c.bucket_cap_mb = 0.0005;
    expect_trains_like_one_process(c, 3);
    expect_trains_like_one_process(c, 4);
  }
}

// A user module with two parameter groups (different learning rates and
// weight decay) against the same optimizer in one process.
struct TwoLayer : torch::nn::Module {
  TwoLayer() {
    torch::manual_seed(5);
    a = register_module("a", torch::nn::Linear(5, 7));
    b = register_module("b", torch::nn::Linear(7, 3));
  }
  torch::Tensor forward(const torch::Tensor& x) { return b(torch::tanh(a(x))); }
  torch::nn::Linear a{nullptr}, b{nullptr};
};

std::unique_ptr<torch::optim::Optimizer> two_groups(TwoLayer& m) {
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(m.a->parameters(), std::make_unique<torch::optim::AdamWOptions>(torch::optim::AdamWOptions(0.05).weight_decay(0.5)));
  groups.emplace_back(m.b->parameters(), std::make_unique<torch::optim::AdamWOptions>(torch::optim::AdamWOptions(0.01).weight_decay(0.0)));
  return std::make_unique<torch::optim::AdamW>(std::move(groups));
}

torch::Tensor batch(int rank, int step) {
  torch::manual_seed(100 * step + rank);
  return torch::randn({4, 5});
}

TEST(Zero, ParameterGroupsEveryStage) {
  run_ranks(3, [](Communicator& comm) {
    auto self = std::shared_ptr<Communicator>(&comm, [](Communicator*) {});
    for (int stage : {1, 2, 3}) {
      auto model = std::make_shared<TwoLayer>();
      auto ref = std::make_shared<TwoLayer>();
      auto ref_opt = two_groups(*ref);
      std::unique_ptr<zero::ZeroRedundancyOptimizer> zro;
      std::unique_ptr<torch::optim::Optimizer> sharded;  // stage 3: the user's optimizer, on the shards
      if (stage < 3) {
        zro = std::make_unique<zero::ZeroRedundancyOptimizer>(model, two_groups(*model), self,
                                                              zero::ZeroOptions().stage(stage).bucket_cap_mb(1e-5));
      } else {
        zero::fully_shard(*model->a, self);  // one unit per layer: a group per layer
        zero::fully_shard(*model->b, self);
        sharded = two_groups(*model);  // model->a->parameters() is now a's shard
      }
      for (int step = 0; step < 4; ++step) {
        zro ? zro->zero_grad() : sharded->zero_grad();
        auto x = batch(comm.rank(), step);
        model->forward(x).pow(2).mean().backward();
        if (zro) zro->step();
        else sharded->step();
        ref_opt->zero_grad();
        torch::Tensor total = torch::zeros({});
        for (int r = 0; r < comm.size(); ++r) total = total + ref->forward(batch(r, step)).pow(2).mean() / comm.size();
        total.backward();
        ref_opt->step();
      }
      auto state = zro ? zro->consolidated_state(0) : zero::full_state(*model, *sharded);
      if (comm.rank() == 0) {
        for (const auto& kv : ref->named_parameters()) {
          EXPECT_TRUE(torch::allclose(state.parameters.at(kv.key()), kv.value(), 1e-4, 1e-6))
              << "stage " << stage << " parameter " << kv.key();
        }
      }
    }
  });
}

// ZeRO-3 as the trainer applies it: zero::fully_shard on each piece, the
// embedding (whose weight the tied head reads) kept gathered through the step.
void shard_pieces(meshtrain::models::StageImpl& model, const std::shared_ptr<Communicator>& dp) {
  for (size_t i = 0; i < model.num_pieces(); ++i)
    zero::fully_shard(*model.piece(i), dp, zero::FullyShardOptions().reshard_after_forward(i != 0));
}

// Train 2 steps on 3 ranks, consolidate, save; load at 2 ranks (another stage),
// train 2 more: the same as 4 steps in one process.
TEST(Zero, ConsolidatedStateLoadsAtAnotherWorldSizeAndStage) {
  auto c = tiny_gpt();
  c.steps = 2;
  meshtrain::train::RunOptions quiet;
  quiet.verbose = false;
  quiet.evaluate = false;
  auto first = run_ranks(3, [&](Communicator& comm) {
    auto self = std::shared_ptr<Communicator>(&comm, [](Communicator*) {});
    auto cfg = c;
    cfg.zero = 3;
    // Build the pieces the trainer builds, shard each through the public API.
    auto model = meshtrain::models::build_stage(cfg.model, 0, meshtrain::models::num_pieces(cfg.model));
    shard_pieces(*model, self);
    torch::optim::AdamW adamw(model->parameters(), torch::optim::AdamWOptions(cfg.lr).eps(cfg.adam_eps));
    auto data = meshtrain::train::make_arithmetic_dataset(cfg.seed, cfg.model.seq_len);
    for (int step = 0; step < 2; ++step) {
      adamw.zero_grad();
      auto b = data->samples(step * cfg.global_batch + comm.rank() * 8, 8);
      meshtrain::models::loss(cfg.model, model->forward(b.inputs), b.targets).backward();
      adamw.step();
    }
    auto state = zero::full_state(*model, adamw);
    if (comm.rank() == 0) {
      std::map<std::string, at::Tensor> flat = state.parameters;
      for (const auto& p : state.optimizer)
        for (const auto& k : p.second) flat["opt/" + p.first + "/" + k.first] = k.second;
      meshtrain::save_tensors(meshtrain::testing::shared_dir() + "/state.bin", flat);
    }
  });
  // The ranks of the next call read the state from the first call's directory
  // (the parent passes its path; the test body reruns in every rank process).
  const std::string state_path = meshtrain::testing::in_rank_process() ? "" : first.file("state.bin");
  auto load_state = [](const std::string& path) {
    zero::FullState state;
    for (const auto& kv : meshtrain::load_tensors(path)) {
      if (kv.first.rfind("opt/", 0) == 0) {
        const auto slash = kv.first.rfind('/');
        state.optimizer[kv.first.substr(4, slash - 4)][kv.first.substr(slash + 1)] = kv.second;
      } else {
        state.parameters[kv.first] = kv.second;
      }
    }
    return state;
  };
  auto data = meshtrain::train::make_arithmetic_dataset(c.seed, c.model.seq_len);
  // Two ranks, stage 1, resuming from the consolidated state.
  meshtrain::testing::RankOptions with_state;
  with_state.env = {"ZERO_TEST_STATE=" + state_path};
  auto second = run_ranks(2, [&](Communicator& comm) {
    auto self = std::shared_ptr<Communicator>(&comm, [](Communicator*) {});
    auto model = meshtrain::models::build_stage(c.model, 0, meshtrain::models::num_pieces(c.model));
    zero::ZeroRedundancyOptimizer zro(model.ptr(), std::make_unique<torch::optim::AdamW>(model->parameters(), torch::optim::AdamWOptions(c.lr).eps(c.adam_eps)),
                                      self, zero::ZeroOptions().stage(1).bucket_cap_mb(0.01));
    zro.load_state(load_state(std::getenv("ZERO_TEST_STATE")));
    for (int step = 2; step < 4; ++step) {
      zro.zero_grad();
      auto b = data->samples(step * c.global_batch + comm.rank() * 12, 12);
      meshtrain::models::loss(c.model, model->forward(b.inputs), b.targets).backward();
      zro.step();
    }
    auto final_state = zro.consolidated_state(0);
    if (comm.rank() == 0) meshtrain::save_tensors(meshtrain::testing::shared_dir() + "/final.bin", final_state.parameters);
  }, with_state);
  if (meshtrain::testing::in_rank_process() || HasFailure()) return;
  const zero::FullState state = load_state(state_path);
  // The optimizer state really is there: AdamW moments and a step count of 2.
  ASSERT_EQ(state.optimizer.at("blocks.0.fc1.weight").at("step").item<int64_t>(), 2);
  ASSERT_EQ(state.optimizer.at("blocks.0.fc1.weight").at("exp_avg").sizes(), state.parameters.at("blocks.0.fc1.weight").sizes());
  // One process: 4 steps straight.
  auto ref_model = meshtrain::models::build_stage(c.model, 0, meshtrain::models::num_pieces(c.model));
  torch::optim::AdamW ref_opt(ref_model->parameters(), torch::optim::AdamWOptions(c.lr).eps(c.adam_eps));
  for (int step = 0; step < 4; ++step) {
    ref_opt.zero_grad();
    auto b = data->samples(step * c.global_batch, c.global_batch);
    meshtrain::models::loss(c.model, ref_model->forward(b.inputs), b.targets).backward();
    ref_opt.step();
  }
  auto final_params = meshtrain::load_tensors(second.file("final.bin"));
  for (const auto& kv : ref_model->named_parameters()) {
    EXPECT_TRUE(torch::allclose(final_params.at(kv.key()), kv.value(), 2e-4, 2e-5)) << kv.key();
  }
}

// The ZeRO paper's memory model for fp32 Adam (4 bytes each for parameters and
// gradients, 8 for Adam's moments), from the tensors each rank holds, and the
// traffic model: stages 1-2 move DDP's bytes, stage 3 about 1.5x.
// Stage 3 on a 6-block GPT, as the trainer shards it: the losses and weights
// are those of one process, and the full parameters held at once never
// exceed the kept embedding plus one block, far below the whole model.
TEST(Zero, StageThreeGathersOneUnitAtATime) {
  run_ranks(3, [](Communicator& comm) {
    auto self = std::shared_ptr<Communicator>(&comm, [](Communicator*) {});
    auto c = tiny_gpt();
    c.model.layers = 6;
    const int64_t per_rank = c.global_batch / comm.size();
    auto data = meshtrain::train::make_arithmetic_dataset(c.seed, c.model.seq_len);
    auto adamw = [&](const std::vector<torch::Tensor>& params) {
      return std::make_unique<torch::optim::AdamW>(params, torch::optim::AdamWOptions(c.lr).eps(c.adam_eps));
    };
    // One process: the whole batch on a dense copy (every rank computes it).
    auto dense = meshtrain::models::build_stage(c.model, 0, meshtrain::models::num_pieces(c.model));
    auto dense_opt = adamw(dense->parameters());
    std::vector<double> want;
    for (int step = 0; step < 3; ++step) {
      dense_opt->zero_grad();
      auto b = data->samples(step * c.global_batch, c.global_batch);
      auto loss = meshtrain::models::loss(c.model, dense->forward(b.inputs), b.targets);
      loss.backward();
      dense_opt->step();
      want.push_back(loss.item<double>());
    }
    auto piece_bytes = [&](size_t i) {
      int64_t bytes = 0;
      for (const auto& p : dense->piece(i)->parameters()) bytes += p.nbytes();
      return bytes;
    };
    int64_t whole = 0, largest_block = 0;
    for (size_t i = 0; i < dense->num_pieces(); ++i) {
      whole += piece_bytes(i);
      if (i > 0) largest_block = std::max(largest_block, piece_bytes(i));
    }
    auto model = meshtrain::models::build_stage(c.model, 0, meshtrain::models::num_pieces(c.model));
    shard_pieces(*model, self);
    auto opt = adamw(model->parameters());
    for (int step = 0; step < 3; ++step) {
      opt->zero_grad();
      auto b = data->samples(step * c.global_batch + comm.rank() * per_rank, per_rank);
      auto loss = meshtrain::models::loss(c.model, model->forward(b.inputs), b.targets);
      loss.backward();
      opt->step();
      auto global = loss.detach().clone();
      comm.all_reduce(global, meshtrain::comm::ReduceOp::kAvg);
      EXPECT_NEAR(global.item<double>(), want[step], 1e-6 + 2e-6 * want[step]) << "step " << step;
    }
    const int64_t peak = zero::peak_gathered_bytes(self);
    EXPECT_GT(peak, 0);
    EXPECT_LE(peak, piece_bytes(0) + largest_block);
    EXPECT_LT(peak, whole / 2);
    auto full = zero::full_parameters(*model);
    if (comm.rank() != 0) return;
    for (const auto& kv : dense->named_parameters()) {
      EXPECT_TRUE(torch::allclose(full.at(kv.key()), kv.value(), 2e-4, 2e-5)) << "parameter " << kv.key();
    }
  });
}

TEST(Zero, MemoryAndTrafficFollowThePaper) {
  std::map<int, double> sent;
  for (int stage : {0, 1, 2, 3}) {
    auto c = tiny_gpt();
    c.zero = stage;
    c.steps = 2;
    c.model.layers = 6;
    const auto m = meshtrain::testing::metrics_on_ranks(c, 4);
    if (meshtrain::testing::in_rank_process() || HasFailure()) continue;
    const double psi = meshtrain::models::parameter_count(c.model), n = 4;
    const double want = stage == 0 ? 16 * psi : stage == 1 ? 8 * psi + 8 * psi / n : stage == 2 ? 4 * psi + 12 * psi / n : 16 * psi / n;
    for (size_t rank = 0; rank < 4; ++rank) {
      const double held = m["ranks"][rank]["state_bytes"]["model_state"].num();
      EXPECT_NEAR(held / want, 1.0, 0.001) << "stage " << stage << " rank " << rank << ": " << held << " bytes, model " << want;
    }
    sent[stage] = m["ranks"][1]["traffic"]["total"]["bytes_sent"].num();
  }
  if (meshtrain::testing::in_rank_process() || HasFailure()) return;
  EXPECT_NEAR(sent[1] / sent[0], 1.0, 0.001) << "stage 1 vs DDP";
  EXPECT_NEAR(sent[2] / sent[0], 1.0, 0.001) << "stage 2 vs DDP";
  // Forward gather + backward gather + reduce-scatter: 1.5x, less the embedding
  // gathered once per step (kept for the tied head).
  EXPECT_GT(sent[3] / sent[0], 1.3);
  EXPECT_LE(sent[3] / sent[0], 1.5 + 1e-3);
}

}  // namespace

namespace {

// Bucket reductions start during backward, not after it: when the first
// layer's gradient is computed (last in backward), the later layers' buckets
// have already been handed to the communicator (counted at launch), unless
// overlap is off.
int64_t launched_before_first_layer_grad(Communicator& comm, bool zero2, bool overlap) {
  auto self = std::shared_ptr<Communicator>(&comm, [](Communicator*) {});
  auto net = torch::nn::Sequential(torch::nn::Linear(8, 8), torch::nn::Tanh(), torch::nn::Linear(8, 8),
                                   torch::nn::Tanh(), torch::nn::Linear(8, 8), torch::nn::Tanh(),
                                   torch::nn::Linear(8, 1));
  const auto kind = zero2 ? meshtrain::comm::OpKind::kReduceScatter : meshtrain::comm::OpKind::kAllReduce;
  int64_t seen = -1;
  auto first = net->named_parameters()["0.weight"];
  first.register_hook([&](const torch::Tensor& g) {
    seen = comm.traffic()[kind].calls;
    return g;
  });
  std::unique_ptr<meshtrain::dp::DistributedDataParallel> ddp;
  std::unique_ptr<zero::ZeroRedundancyOptimizer> zro;
  if (zero2) {
    zro = std::make_unique<zero::ZeroRedundancyOptimizer>(
        net.ptr(), std::make_unique<torch::optim::SGD>(net->parameters(), torch::optim::SGDOptions(0.1)), self,
        zero::ZeroOptions().stage(2).bucket_cap_mb(1e-6).overlap(overlap));
  } else {
    ddp = std::make_unique<meshtrain::dp::DistributedDataParallel>(
        net.ptr(), self,
        meshtrain::dp::DistributedDataParallelOptions().bucket_cap_mb(1e-6).first_bucket_cap_mb(1e-6).overlap(overlap));
  }
  comm.reset_traffic();
  net->forward(torch::ones({4, 8}) * (comm.rank() + 1)).sum().backward();
  if (zro) zro->step();
  return seen;
}

}  // namespace

TEST(Zero, DdpAndStageTwoReduceBucketsDuringBackward) {
  run_ranks(2, [](Communicator& comm) {
    for (bool zero2 : {false, true}) {
      EXPECT_GT(launched_before_first_layer_grad(comm, zero2, /*overlap=*/true), 0) << (zero2 ? "ZeRO-2" : "DDP");
      EXPECT_EQ(launched_before_first_layer_grad(comm, zero2, /*overlap=*/false), 0) << (zero2 ? "ZeRO-2" : "DDP");
    }
  });
}
