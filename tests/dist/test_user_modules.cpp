// The strategies applied to a user's own modules (dp::replicate, pp::pipeline
// and both together) train exactly like one process.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>

#include <optional>

#include "harness.h"
#include "meshtrain/comm.h"
#include "meshtrain/dp.h"
#include "meshtrain/mesh.h"
#include "meshtrain/pp.h"
#include "meshtrain/tp.h"
#include "tp/shards.h"
#include "meshtrain/util.h"
#include "util/shard.h"
#include "meshtrain/zero.h"

using meshtrain::comm::CommPtr;
using meshtrain::comm::Communicator;
using meshtrain::testing::run_ranks;

namespace {

// A user's model: 7 children (no stage count from 2 to 4 divides them), some
// without parameters, layers of different sizes.
torch::nn::Sequential user_model() {
  torch::manual_seed(42);
  return torch::nn::Sequential(torch::nn::Linear(6, 16), torch::nn::Tanh(), torch::nn::Linear(16, 24),
                               torch::nn::Tanh(), torch::nn::Linear(24, 16), torch::nn::ReLU(), torch::nn::Linear(16, 3));
}

torch::Tensor batch_inputs(int step) {
  torch::manual_seed(100 + step);
  return torch::randn({12, 6});
}
torch::Tensor batch_targets(const torch::Tensor& x) { return torch::stack({x.sum(1), x.prod(1), x.sin().sum(1)}, 1); }

torch::Tensor mse(const torch::Tensor& y, const torch::Tensor& t) { return torch::mse_loss(y, t); }

CommPtr borrowed(Communicator& c) { return CommPtr(&c, [](Communicator*) {}); }

// One process: losses per step and the final parameters, by name.
struct Reference {
  std::vector<double> losses;
  std::map<std::string, torch::Tensor> params;
};
// `model` trained for `steps` on batch(step) -> (inputs, targets) with SGD
// (momentum 0.9), each parameter given to the optimizer once (libtorch's
// parameters() lists a tied one under both names: it would be stepped twice).
Reference train_reference(torch::nn::Sequential model, int steps, double lr,
                          const std::function<std::pair<torch::Tensor, torch::Tensor>(int)>& batch,
                          const std::function<torch::Tensor(const torch::Tensor&, const torch::Tensor&)>& loss_fn) {
  std::vector<torch::Tensor> once;
  for (const auto& p : meshtrain::dp::unique_parameters(*model)) once.push_back(p.tensor);
  torch::optim::SGD opt(once, torch::optim::SGDOptions(lr).momentum(0.9));
  Reference r;
  for (int step = 0; step < steps; ++step) {
    const auto xy = batch(step);
    opt.zero_grad();
    auto loss = loss_fn(model->forward(xy.first), xy.second);
    loss.backward();
    opt.step();
    r.losses.push_back(loss.item<double>());
  }
  for (const auto& kv : model->named_parameters()) r.params[kv.key()] = kv.value().detach().clone();
  return r;
}

Reference train_one_process(int steps) {
  return train_reference(user_model(), steps, 0.05, [](int step) {
    auto x = batch_inputs(step);
    return std::make_pair(x, batch_targets(x));
  }, mse);
}

void expect_matches(const Reference& ref, const std::vector<double>& losses, const torch::nn::Module& stage,
                    const std::string& where) {
  ASSERT_EQ(losses.size(), ref.losses.size());
  for (size_t s = 0; s < losses.size(); ++s) EXPECT_NEAR(losses[s], ref.losses[s], 1e-5 * (1 + ref.losses[s])) << where << " step " << s;
  int compared = 0;
  for (const auto& kv : stage.named_parameters()) {
    auto it = ref.params.find(kv.key());
    ASSERT_NE(it, ref.params.end()) << where << ": " << kv.key() << " is not a parameter of the whole model";
    EXPECT_TRUE(torch::allclose(kv.value(), it->second, 1e-5, 1e-6)) << where << " parameter " << kv.key();
    ++compared;
  }
  EXPECT_GT(compared, 0) << where << ": the stage holds no parameters";
}

constexpr int kSteps = 5;

// kSteps optimizer steps of a pipeline stage on batches inputs(step), targets(x); the losses.
std::vector<double> train_stage(meshtrain::pp::Pipeline& stage, torch::optim::Optimizer& opt,
                                const std::function<torch::Tensor(int)>& inputs,
                                const std::function<torch::Tensor(const torch::Tensor&)>& targets) {
  std::vector<double> losses;
  for (int step = 0; step < kSteps; ++step) {
    const torch::Tensor x = inputs(step);
    opt.zero_grad();
    losses.push_back(stage.step(x, targets(x)));
    opt.step();
  }
  return losses;
}

// The loss of this rank's part of the batch, averaged over dp (equal parts).
double mean_over(const CommPtr& dp, const torch::Tensor& loss) {
  auto total = loss.detach().to(torch::kDouble).reshape({1});
  dp->all_reduce(total, meshtrain::comm::ReduceOp::kAvg);
  return total.item<double>();
}


TEST(UserModules, PipelineOfASequentialMatchesOneProcess) {
  const Reference ref = train_one_process(kSteps);
  for (const char* schedule : {"gpipe", "1f1b"})
    for (int stages : {2, 3, 4}) {
      run_ranks(stages, [&](Communicator& comm) {
        auto stage = meshtrain::pp::pipeline(user_model(), borrowed(comm), mse,
                                             meshtrain::pp::PipelineOptions().schedule(schedule).microbatches(3));
        torch::optim::SGD opt(stage->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
        const std::vector<double> losses = train_stage(stage, opt, batch_inputs, batch_targets);
        expect_matches(ref, losses, *stage.module(),
                       std::string(schedule) + " on " + std::to_string(stages) + " stages, rank " + std::to_string(comm.rank()));
      });
    }
}

// dp 2 x pp 2 and dp 3 x pp 2: each replica of the pipeline trains on its rows
// of the batch; replicate's averaging makes the whole-batch step of one process.
TEST(UserModules, PipelineInsideReplicateMatchesOneProcess) {
  const Reference ref = train_one_process(kSteps);
  for (int dp : {2, 3}) {
    run_ranks(2 * dp, [&](Communicator& comm) {
      meshtrain::mesh::DeviceMesh mesh(borrowed(comm),
          meshtrain::mesh::MeshLayout(comm.size(), meshtrain::mesh::MeshDims().dp(dp).pp(2)));
      auto stage = meshtrain::pp::pipeline(user_model(), mesh.pp(), mse,
                                           meshtrain::pp::PipelineOptions().split_points({3}).microbatches(2));
      auto replicated = meshtrain::dp::replicate(stage.module(), mesh.dp());
      torch::optim::SGD opt(replicated->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
      std::vector<double> losses;
      const int64_t rows = 12 / dp, first = mesh.coord().dp * rows;
      mesh.dp()->reset_traffic();
      for (int step = 0; step < kSteps; ++step) {
        auto x = batch_inputs(step);
        auto mine = x.narrow(0, first, rows);
        opt.zero_grad();
        torch::Tensor loss = torch::tensor({stage.step(mine, batch_targets(mine))}, torch::kDouble);
        mesh.dp()->all_reduce(loss, meshtrain::comm::ReduceOp::kAvg);
        opt.step();
        losses.push_back(loss.item<double>());
      }
      expect_matches(ref, losses, *stage.module(), "dp " + std::to_string(dp) + " x pp 2, rank " + std::to_string(comm.rank()));
      // The pipeline paused the reduction for the first micro-batch: one
      // all-reduce of the gradients (one bucket) per step, plus the test's loss.
      EXPECT_EQ(mesh.dp()->traffic()[meshtrain::comm::OpKind::kAllReduce].calls, 2 * kSteps) << "rank " << comm.rank();
    });
  }
}

// The same with ZeRO stage 2 on the data axis instead of DDP: the pipeline
// pauses its reduce-scatter for the first micro-batch too.
TEST(UserModules, PipelineInsideZeroStage2MatchesOneProcess) {
  const Reference ref = train_one_process(kSteps);
  run_ranks(4, [&](Communicator& comm) {
    meshtrain::mesh::DeviceMesh mesh(borrowed(comm),
        meshtrain::mesh::MeshLayout(4, meshtrain::mesh::MeshDims().dp(2).pp(2)));
    auto stage = meshtrain::pp::pipeline(user_model(), mesh.pp(), mse, meshtrain::pp::PipelineOptions().microbatches(2));
    auto sgd = std::make_unique<torch::optim::SGD>(stage->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    meshtrain::zero::ZeroRedundancyOptimizer zero(stage.module(), std::move(sgd), mesh.dp(),
                                                  meshtrain::zero::ZeroOptions().stage(2));
    std::vector<double> losses;
    mesh.dp()->reset_traffic();
    for (int step = 0; step < kSteps; ++step) {
      auto mine = batch_inputs(step).narrow(0, mesh.coord().dp * 6, 6);
      zero.zero_grad();
      torch::Tensor loss = torch::tensor({stage.step(mine, batch_targets(mine))}, torch::kDouble);
      mesh.dp()->all_reduce(loss, meshtrain::comm::ReduceOp::kAvg);
      zero.step();
      losses.push_back(loss.item<double>());
    }
    expect_matches(ref, losses, *stage.module(), "dp 2 x pp 2 ZeRO-2, rank " + std::to_string(comm.rank()));
    // One bucket: one reduce-scatter per step (the second micro-batch's), not two.
    EXPECT_EQ(mesh.dp()->traffic()[meshtrain::comm::OpKind::kReduceScatter].calls, kSteps) << "rank " << comm.rank();
  });
}

// Interleaved: 7 children cut into pp x 2 stages, rank r holding stages r and
// r + pp (pp 2: 4 stages; pp 3: 6 stages); micro-batches a multiple of pp.
TEST(UserModules, InterleavedPipelineOfASequentialMatchesOneProcess) {
  const Reference ref = train_one_process(kSteps);
  for (int ranks : {2, 3}) {
    run_ranks(ranks, [&](Communicator& comm) {
      auto stage = meshtrain::pp::pipeline(user_model(), borrowed(comm), mse,
                                           meshtrain::pp::PipelineOptions().schedule("interleaved").virtual_stages(2).microbatches(ranks == 2 ? 4 : 6));
      ASSERT_EQ(stage.chunks().size(), 2u);
      torch::optim::SGD opt(stage->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
      const std::vector<double> losses = train_stage(stage, opt, batch_inputs, batch_targets);
      expect_matches(ref, losses, *stage.module(), "interleaved on " + std::to_string(ranks) + " ranks, rank " + std::to_string(comm.rank()));
    });
  }
}

// dp 2 x pp 2 interleaved: each chunk replicated on its own (its backward runs
// apart), one all-reduce per chunk per step; or the children fully sharded.
// A replica of the whole stage is refused before any communication.
TEST(UserModules, InterleavedPipelineWithDataParallelChunksMatchesOneProcess) {
  const Reference ref = train_one_process(kSteps);
  for (const std::string wrap : {"replicate", "fully_shard", "whole"}) {
    run_ranks(4, [&](Communicator& comm) {
      meshtrain::mesh::DeviceMesh mesh(borrowed(comm),
          meshtrain::mesh::MeshLayout(4, meshtrain::mesh::MeshDims().dp(2).pp(2)));
      auto stage = meshtrain::pp::pipeline(user_model(), mesh.pp(), mse,
                                           meshtrain::pp::PipelineOptions().schedule("interleaved").virtual_stages(2).microbatches(2));
      std::vector<meshtrain::dp::Replicated<torch::nn::Module>> replicas;
      std::vector<torch::Tensor> params;
      if (wrap == "replicate") {
        for (const auto& chunk : stage.chunks()) replicas.push_back(meshtrain::dp::replicate(chunk, mesh.dp()));
        params = stage->parameters();
      } else if (wrap == "fully_shard") {
        for (const auto& child : stage->children())
          if (!child->parameters().empty()) meshtrain::zero::fully_shard(*child, mesh.dp());
        params = meshtrain::zero::sharded_parameters(*stage.module());
      } else {
        replicas.push_back(meshtrain::dp::replicate(stage.module(), mesh.dp()));
        params = stage->parameters();
      }
      torch::optim::SGD opt(params, torch::optim::SGDOptions(0.05).momentum(0.9));
      std::vector<double> losses;
      for (int step = 0; step < kSteps; ++step) {
        auto mine = batch_inputs(step).narrow(0, mesh.coord().dp * 6, 6);
        opt.zero_grad();
        mesh.dp()->reset_traffic();
        if (wrap == "whole") {
          EXPECT_THROW(stage.step(mine, batch_targets(mine)), meshtrain::ConfigError);
          return;
        }
        const double loss = stage.step(mine, batch_targets(mine));
        if (wrap == "replicate") {
          EXPECT_EQ(mesh.dp()->traffic()[meshtrain::comm::OpKind::kAllReduce].calls, 2) << "step " << step;
        }
        losses.push_back(mean_over(mesh.dp(), torch::tensor(loss, torch::kDouble)));
        opt.step();
      }
      const std::string where = wrap + ", rank " + std::to_string(comm.rank());
      for (size_t s = 0; s < losses.size(); ++s) EXPECT_NEAR(losses[s], ref.losses[s], 1e-5 * (1 + ref.losses[s])) << where;
      for (const auto& kv : meshtrain::zero::full_parameters(*stage.module()))  // as named_parameters() when unsharded
        EXPECT_TRUE(torch::allclose(kv.second, ref.params.at(kv.first), 1e-4, 1e-6)) << where << " parameter " << kv.first;
    });
  }
}

TEST(UserModules, PipelineRejectsABatchItsMicroBatchesDoNotDivide) {
  run_ranks(2, [](Communicator& comm) {
    auto stage = meshtrain::pp::pipeline(user_model(), borrowed(comm), mse, meshtrain::pp::PipelineOptions().microbatches(5));
    auto x = batch_inputs(0);
    try {
      stage.step(x, batch_targets(x));
      ADD_FAILURE() << "no error for 12 samples in 5 micro-batches";
    } catch (const meshtrain::ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("12 samples, which 5 micro-batches do not divide"), std::string::npos) << e.what();
    }
  });
}

// A user's model with plain Linear layers, called as members.
struct Net : torch::nn::Module {
  Net() {
    torch::manual_seed(9);
    pre = register_module("pre", torch::nn::Linear(4, 6));
    block = register_module("block", std::make_shared<Block>());
    head = register_module("head", torch::nn::Linear(5, 3));
  }
  struct Block : torch::nn::Module {
    torch::nn::Linear fc1{register_module("fc1", torch::nn::Linear(6, 12))};
    torch::nn::Linear fc2{register_module("fc2", torch::nn::Linear(12, 5))};
    torch::Tensor forward(const torch::Tensor& x) { return fc2(torch::relu(fc1(x))); }
  };
  torch::Tensor forward(const torch::Tensor& x) { return head(torch::tanh(block->forward(torch::tanh(pre(x))))); }
  torch::nn::Linear pre{nullptr}, head{nullptr};
  std::shared_ptr<Block> block;
};

const std::map<std::string, meshtrain::tp::Style> kPlan = {{"block.fc1", meshtrain::tp::Style::kColwise},
                                                           {"block.fc2", meshtrain::tp::Style::kRowwise}};

// 2-D and 3-D batches in turn (Linear's forward takes addmm, then mm + add_).
torch::Tensor net_batch(int step) {
  torch::manual_seed(200 + step);
  return step % 2 ? torch::randn({4, 3, 4}) : torch::randn({8, 4});
}

Reference train_net_on(const std::function<torch::Tensor(int)>& batch, int steps) {
  auto model = std::make_shared<Net>();
  torch::optim::Adam opt(model->parameters(), 0.01);
  Reference r;
  for (int step = 0; step < steps; ++step) {
    opt.zero_grad();
    auto loss = model->forward(batch(step)).pow(2).mean();
    loss.backward();
    opt.step();
    r.losses.push_back(loss.item<double>());
  }
  for (const auto& kv : model->named_parameters()) r.params[kv.key()] = kv.value().detach().clone();
  return r;
}

// The slice of the one-process parameter that tp rank r holds under kPlan.
torch::Tensor expected_slice(const std::string& name, const torch::Tensor& full, int r, int n) {
  if (name == "block.fc1.weight" || name == "block.fc1.bias") return full.chunk(n, 0)[r];
  if (name == "block.fc2.weight") return full.chunk(n, 1)[r];
  return full;
}

void expect_tp_matches(const Reference& ref, const std::vector<double>& losses, const Net& model, int tp_rank, int tp,
                       const std::string& where) {
  for (size_t s = 0; s < losses.size(); ++s) EXPECT_NEAR(losses[s], ref.losses[s], 1e-5 * (1 + ref.losses[s])) << where << " step " << s;
  for (const auto& kv : model.named_parameters()) {
    EXPECT_TRUE(torch::allclose(kv.value(), expected_slice(kv.key(), ref.params.at(kv.key()), tp_rank, tp), 1e-4, 1e-6))
        << where << " parameter " << kv.key();
  }
}

TEST(UserModules, ParallelizedPlainLinearsMatchOneProcess) {
  const Reference ref = train_net_on(net_batch, kSteps);
  for (int tp : {2, 3}) {
    run_ranks(tp, [&](Communicator& comm) {
      auto model = std::make_shared<Net>();
      torch::optim::Adam opt(model->parameters(), 0.01);  // built before: the parameters stay the same tensors
      meshtrain::tp::parallelize(*model, borrowed(comm), kPlan);
      EXPECT_EQ(model->block->fc1->weight.size(0), 12 / tp);
      std::vector<double> losses;
      for (int step = 0; step < kSteps; ++step) {
        opt.zero_grad();
        auto loss = model->forward(net_batch(step)).pow(2).mean();
        loss.backward();
        opt.step();
        losses.push_back(loss.item<double>());
      }
      expect_tp_matches(ref, losses, *model, comm.rank(), tp, "tp " + std::to_string(tp) + " rank " + std::to_string(comm.rank()));
    });
  }
}

// dp 2 x tp 2: tp::parallelize along tp, dp::replicate along dp; each replica its half of the batch.
TEST(UserModules, ParallelizeInsideReplicateMatchesOneProcess) {
  const Reference ref = train_net_on(net_batch, kSteps);
  run_ranks(4, [&](Communicator& comm) {
    meshtrain::mesh::DeviceMesh mesh(borrowed(comm),
        meshtrain::mesh::MeshLayout(4, meshtrain::mesh::MeshDims().dp(2).tp(2)));
    auto net = std::make_shared<Net>();
    meshtrain::tp::parallelize(*net, mesh.tp(), kPlan);
    auto model = meshtrain::dp::replicate(net, mesh.dp());
    torch::optim::Adam opt(model->parameters(), 0.01);
    std::vector<double> losses;
    for (int step = 0; step < kSteps; ++step) {
      auto x = net_batch(step);
      auto mine = x.chunk(2, 0)[mesh.coord().dp];
      opt.zero_grad();
      auto loss = model->forward(mine).pow(2).mean();
      loss.backward();
      opt.step();
      auto total = loss.detach().to(torch::kDouble).reshape({1});
      mesh.dp()->all_reduce(total, meshtrain::comm::ReduceOp::kAvg);
      losses.push_back(total.item<double>());
    }
    expect_tp_matches(ref, losses, *net, mesh.coord().tp, 2, "dp 2 x tp 2, rank " + std::to_string(comm.rank()));
  });
}

TEST(UserModules, ParallelizeNamesTheLayerAndTheFix) {
  run_ranks(3, [](Communicator& comm) {
    auto expect_error = [&](const std::map<std::string, meshtrain::tp::Style>& plan, const std::string& says) {
      auto model = std::make_shared<Net>();
      try {
        meshtrain::tp::parallelize(*model, borrowed(comm), plan);
        ADD_FAILURE() << "no error; expected: " << says;
      } catch (const meshtrain::ConfigError& e) {
        EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
      }
    };
    expect_error({{"block.fc3", meshtrain::tp::Style::kColwise}}, "no layer 'block.fc3'; its Linear and Embedding layers are [pre, block.fc1, block.fc2, head]");
    expect_error({{"block", meshtrain::tp::Style::kColwise}}, "kColwise applies to torch::nn::Linear");
    expect_error({{"pre", meshtrain::tp::Style::kVocabParallel}}, "kVocabParallel applies to torch::nn::Embedding");
    expect_error({{"block.fc2", meshtrain::tp::Style::kColwise}}, "'block.fc2' has 5 output features, which tp 3 does not divide");
  });
}

// dp 2 x pp 2 x tp 2 on the user's Sequential: children 2 and 4 split over tp
// (column then row), the pipeline cut between them (child 2's sliced output
// crosses to the next stage), each pipeline replicated over dp.
TEST(UserModules, ParallelizePipelineAndReplicateTogetherMatchOneProcess) {
  const Reference ref = train_one_process(kSteps);
  run_ranks(8, [&](Communicator& comm) {
    meshtrain::mesh::DeviceMesh mesh(borrowed(comm),
        meshtrain::mesh::MeshLayout(8, meshtrain::mesh::MeshDims().dp(2).pp(2).tp(2)));
    const auto me = mesh.coord();
    auto model = user_model();
    meshtrain::tp::parallelize(*model, mesh.tp(), {{"2", meshtrain::tp::Style::kColwise}, {"4", meshtrain::tp::Style::kRowwise}});
    auto stage = meshtrain::pp::pipeline(model, mesh.pp(), mse, meshtrain::pp::PipelineOptions().split_points({3}).microbatches(2));
    auto replicated = meshtrain::dp::replicate(stage.module(), mesh.dp());
    torch::optim::SGD opt(replicated->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    std::vector<double> losses;
    for (int step = 0; step < kSteps; ++step) {
      auto mine = batch_inputs(step).narrow(0, me.dp * 6, 6);
      opt.zero_grad();
      torch::Tensor loss = torch::tensor({stage.step(mine, batch_targets(mine))}, torch::kDouble);
      mesh.dp()->all_reduce(loss, meshtrain::comm::ReduceOp::kAvg);
      opt.step();
      losses.push_back(loss.item<double>());
    }
    const std::string where = "rank " + std::to_string(comm.rank());
    for (size_t s = 0; s < losses.size(); ++s) EXPECT_NEAR(losses[s], ref.losses[s], 1e-5 * (1 + ref.losses[s])) << where;
    for (const auto& kv : stage->named_parameters()) {
      torch::Tensor full = ref.params.at(kv.key());
      if (kv.key() == "2.weight" || kv.key() == "2.bias") full = full.chunk(2, 0)[me.tp];
      if (kv.key() == "4.weight") full = full.chunk(2, 1)[me.tp];
      EXPECT_TRUE(torch::allclose(kv.value(), full, 1e-4, 1e-6)) << where << " parameter " << kv.key();
    }
  });
}

// ---- zero::fully_shard on the user's plain modules

// Batches of 12 rows (2-D) or 6 x 2 (3-D): every dp size up to 3 splits them.
torch::Tensor shard_batch(int step) {
  torch::manual_seed(300 + step);
  return step % 2 ? torch::randn({6, 2, 4}) : torch::randn({12, 4});
}

int64_t bytes_of(const torch::nn::Module& m) {
  int64_t b = 0;
  for (const auto& p : m.parameters()) b += p.numel() * p.element_size();
  return b;
}

// ZeRO-3 at dp 2 and 3 (the units' sizes do not divide by 3): each block
// layer a unit, the root's pre and head one more kept gathered through the
// step; the user's forward unchanged. Between steps a rank holds its shards
// only; the weights match one process after 5 Adam steps.
TEST(UserModules, FullyShardedPlainModulesMatchOneProcess) {
  const Reference ref = train_net_on(shard_batch, kSteps);
  for (int dp : {2, 3}) {
    run_ranks(dp, [&](Communicator& comm) {
      const CommPtr world = borrowed(comm);
      auto model = std::make_shared<Net>();
      const int64_t full_bytes = bytes_of(*model), root_bytes = bytes_of(*model->pre) + bytes_of(*model->head);
      meshtrain::zero::fully_shard(*model->block->fc1, world);
      meshtrain::zero::fully_shard(*model->block->fc2, world);
      meshtrain::zero::fully_shard(*model, world, meshtrain::zero::FullyShardOptions().reshard_after_forward(false));
      // The module's parameters are now its three units' shards, as with FSDP's flat parameters.
      const auto shards = meshtrain::zero::sharded_parameters(*model);
      ASSERT_EQ(shards.size(), 3u);
      ASSERT_EQ(model->parameters().size(), 3u);
      for (size_t i = 0; i < 3; ++i) EXPECT_TRUE(model->parameters()[i].is_same(shards[i]));
      torch::optim::Adam opt(model->parameters(), 0.01);
      std::vector<double> losses;
      for (int step = 0; step < kSteps; ++step) {
        opt.zero_grad();
        auto loss = model->forward(shard_batch(step).chunk(dp, 0)[comm.rank()]).pow(2).mean();
        // After forward only the root (pre, head) is whole: each block layer was freed when the next began.
        EXPECT_LE(meshtrain::zero::held_parameter_bytes(*model), full_bytes / dp + 3 * 4 + root_bytes);
        loss.backward();
        // Every unit freed after backward: the shards are all a rank holds.
        EXPECT_LE(meshtrain::zero::held_parameter_bytes(*model), full_bytes / dp + 3 * 4);
        {  // an evaluation between backward and step leaves the root gathered with the values before the step
          torch::NoGradGuard no_grad;
          model->forward(shard_batch(step));
        }
        opt.step();  // the root is gathered again at its next use: the shard changed
        losses.push_back(mean_over(world, loss));
      }
      const std::string where = "dp " + std::to_string(dp) + " rank " + std::to_string(comm.rank());
      for (size_t s = 0; s < losses.size(); ++s) EXPECT_NEAR(losses[s], ref.losses[s], 1e-5 * (1 + ref.losses[s])) << where;
      const auto full = meshtrain::zero::full_parameters(*model);
      ASSERT_EQ(full.size(), ref.params.size());
      for (const auto& kv : full) EXPECT_TRUE(torch::allclose(kv.second, ref.params.at(kv.first), 1e-4, 1e-6)) << where << " " << kv.first;
    });
  }
}

// dp 2 x tp 2: the block's layers split over tp by tp::parallelize, then every
// layer's slices sharded over dp: a unit of tp slices.
TEST(UserModules, FullyShardOfParallelizedLayersMatchesOneProcess) {
  const Reference ref = train_net_on(shard_batch, kSteps);
  run_ranks(4, [&](Communicator& comm) {
    meshtrain::mesh::DeviceMesh mesh(borrowed(comm),
        meshtrain::mesh::MeshLayout(4, meshtrain::mesh::MeshDims().dp(2).tp(2)));
    auto model = std::make_shared<Net>();
    meshtrain::tp::parallelize(*model, mesh.tp(), kPlan);
    meshtrain::zero::fully_shard(*model->block, mesh.dp());
    meshtrain::zero::fully_shard(*model, mesh.dp());
    torch::optim::Adam opt(meshtrain::zero::sharded_parameters(*model), 0.01);
    std::vector<double> losses;
    for (int step = 0; step < kSteps; ++step) {
      opt.zero_grad();
      auto loss = model->forward(shard_batch(step).chunk(2, 0)[mesh.coord().dp]).pow(2).mean();
      loss.backward();
      opt.step();
      losses.push_back(mean_over(mesh.dp(), loss));
    }
    const std::string where = "rank " + std::to_string(comm.rank());
    for (size_t s = 0; s < losses.size(); ++s) EXPECT_NEAR(losses[s], ref.losses[s], 1e-5 * (1 + ref.losses[s])) << where;
    for (const auto& kv : meshtrain::zero::full_parameters(*model)) {
      const auto expected = expected_slice(kv.first, ref.params.at(kv.first), mesh.coord().tp, 2);
      EXPECT_TRUE(torch::allclose(kv.second, expected, 1e-4, 1e-6)) << where << " " << kv.first;
    }
  });
}

// dp 2 x pp 2: each pipeline stage one unit over dp. The pipeline pauses the
// reduction between its micro-batches: one reduce-scatter per step.
TEST(UserModules, PipelineOfFullyShardedStagesMatchesOneProcess) {
  const Reference ref = train_one_process(kSteps);
  run_ranks(4, [&](Communicator& comm) {
    meshtrain::mesh::DeviceMesh mesh(borrowed(comm),
        meshtrain::mesh::MeshLayout(4, meshtrain::mesh::MeshDims().dp(2).pp(2)));
    auto stage = meshtrain::pp::pipeline(user_model(), mesh.pp(), mse, meshtrain::pp::PipelineOptions().microbatches(3));
    meshtrain::zero::fully_shard(*stage.module(), mesh.dp());
    torch::optim::SGD opt(stage->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    std::vector<double> losses;
    for (int step = 0; step < kSteps; ++step) {
      auto mine = batch_inputs(step).narrow(0, mesh.coord().dp * 6, 6);
      opt.zero_grad();
      mesh.dp()->reset_traffic();
      const double loss = stage.step(mine, batch_targets(mine));
      EXPECT_EQ(mesh.dp()->traffic()[meshtrain::comm::OpKind::kReduceScatter].calls, 1) << "step " << step;
      opt.step();
      losses.push_back(mean_over(mesh.dp(), torch::tensor(loss, torch::kDouble)));
    }
    const std::string where = "rank " + std::to_string(comm.rank());
    for (size_t s = 0; s < losses.size(); ++s) EXPECT_NEAR(losses[s], ref.losses[s], 1e-5 * (1 + ref.losses[s])) << where;
    for (const auto& kv : meshtrain::zero::full_parameters(*stage.module()))
      EXPECT_TRUE(torch::allclose(kv.second, ref.params.at(kv.first), 1e-4, 1e-6)) << where << " " << kv.first;
  });
}

// dp 2 x pp 2 x tp 2 x ZeRO-3 on the user's Sequential: tp slices children 2
// and 4, the pipeline cuts after child 3, every stage's layers are sharded
// over dp, child by child.
TEST(UserModules, ParallelizePipelineAndFullyShardTogetherMatchOneProcess) {
  const Reference ref = train_one_process(kSteps);
  run_ranks(8, [&](Communicator& comm) {
    meshtrain::mesh::DeviceMesh mesh(borrowed(comm),
        meshtrain::mesh::MeshLayout(8, meshtrain::mesh::MeshDims().dp(2).pp(2).tp(2)));
    const auto me = mesh.coord();
    auto model = user_model();
    meshtrain::tp::parallelize(*model, mesh.tp(), {{"2", meshtrain::tp::Style::kColwise}, {"4", meshtrain::tp::Style::kRowwise}});
    auto stage = meshtrain::pp::pipeline(model, mesh.pp(), mse, meshtrain::pp::PipelineOptions().split_points({3}).microbatches(2));
    for (const auto& child : stage->children())
      if (!child->parameters().empty()) meshtrain::zero::fully_shard(*child, mesh.dp());
    torch::optim::SGD opt(meshtrain::zero::sharded_parameters(*stage.module()), torch::optim::SGDOptions(0.05).momentum(0.9));
    std::vector<double> losses;
    for (int step = 0; step < kSteps; ++step) {
      auto mine = batch_inputs(step).narrow(0, me.dp * 6, 6);
      opt.zero_grad();
      losses.push_back(mean_over(mesh.dp(), torch::tensor(stage.step(mine, batch_targets(mine)), torch::kDouble)));
      opt.step();
    }
    const std::string where = "rank " + std::to_string(comm.rank());
    for (size_t s = 0; s < losses.size(); ++s) EXPECT_NEAR(losses[s], ref.losses[s], 1e-5 * (1 + ref.losses[s])) << where;
    for (const auto& kv : meshtrain::zero::full_parameters(*stage.module())) {
      torch::Tensor full = ref.params.at(kv.first);
      if (kv.first == "2.weight" || kv.first == "2.bias") full = full.chunk(2, 0)[me.tp];
      if (kv.first == "4.weight") full = full.chunk(2, 1)[me.tp];
      EXPECT_TRUE(torch::allclose(kv.second, full, 1e-4, 1e-6)) << where << " parameter " << kv.first;
    }
  });
}

// A user's attention block whose forward reads the head count from the
// tensor (view(B, T, -1, head_dim)), so it runs unchanged on a tp rank's heads.
struct Attention : torch::nn::Module {
  Attention() {
    torch::manual_seed(11);
    for (const char* name : {"q", "k", "v", "out"}) layers.emplace(name, register_module(name, torch::nn::Linear(8, 8)));
    fc1 = register_module("fc1", torch::nn::Linear(8, 16));
    fc2 = register_module("fc2", torch::nn::Linear(16, 8));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    const int64_t B = x.size(0), T = x.size(1);
    auto heads = [&](const char* l) { return layers.at(l)(x).view({B, T, -1, 2}).transpose(1, 2); };
    auto scores = torch::softmax(torch::matmul(heads("q"), heads("k").transpose(-2, -1)), -1);
    auto h = x + layers.at("out")(torch::matmul(scores, heads("v")).transpose(1, 2).reshape({B, T, -1}));
    return h + fc2(torch::gelu(fc1(h)));
  }
  std::map<std::string, torch::nn::Linear> layers;
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};

// dp 2 x tp 2 on the attention block (4 heads of 2: each tp rank 2 heads),
// ZeRO-3 along dp, against one process. SGD, not Adam: k's bias gets a zero
// gradient (softmax ignores a shift shared by all keys), and Adam would turn
// its rounding noise into full-size steps.
TEST(UserModules, AttentionOfAUserBlockParallelizedAndShardedMatchesOneProcess) {
  auto data = [](int step) {
    torch::manual_seed(400 + step);
    return torch::randn({4, 5, 8});
  };
  std::vector<double> ref_losses;
  std::map<std::string, torch::Tensor> ref_params;
  {
    Attention model;
    torch::optim::SGD opt(model.parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    for (int step = 0; step < kSteps; ++step) {
      opt.zero_grad();
      auto loss = model.forward(data(step)).pow(2).mean();
      loss.backward();
      opt.step();
      ref_losses.push_back(loss.item<double>());
    }
    for (const auto& kv : model.named_parameters()) ref_params[kv.key()] = kv.value().detach().clone();
  }
  run_ranks(4, [&](Communicator& comm) {
    meshtrain::mesh::DeviceMesh mesh(borrowed(comm),
        meshtrain::mesh::MeshLayout(4, meshtrain::mesh::MeshDims().dp(2).tp(2)));
    Attention model;
    using meshtrain::tp::Style;
    meshtrain::tp::parallelize(model, mesh.tp(), {{"q", Style::kColwise}, {"k", Style::kColwise}, {"v", Style::kColwise},
                                                  {"out", Style::kRowwise}, {"fc1", Style::kColwise}, {"fc2", Style::kRowwise}});
    meshtrain::zero::fully_shard(model, mesh.dp());
    torch::optim::SGD opt(meshtrain::zero::sharded_parameters(model), torch::optim::SGDOptions(0.05).momentum(0.9));
    const std::string where = "rank " + std::to_string(comm.rank());
    for (int step = 0; step < kSteps; ++step) {
      opt.zero_grad();
      auto loss = model.forward(data(step).chunk(2, 0)[mesh.coord().dp]).pow(2).mean();
      loss.backward();
      opt.step();
      EXPECT_NEAR(mean_over(mesh.dp(), loss), ref_losses[step], 1e-5 * (1 + ref_losses[step])) << where << " step " << step;
    }
    for (const auto& kv : meshtrain::zero::full_parameters(model)) {
      torch::Tensor full = ref_params.at(kv.first);
      const std::string layer = kv.first.substr(0, kv.first.find('.'));
      const bool col = layer == "q" || layer == "k" || layer == "v" || layer == "fc1";
      if (col) full = full.chunk(2, 0)[mesh.coord().tp];
      if ((layer == "out" || layer == "fc2") && kv.first.find("weight") != std::string::npos) full = full.chunk(2, 1)[mesh.coord().tp];
      EXPECT_TRUE(torch::allclose(kv.second, full, 1e-4, 1e-6)) << where << " parameter " << kv.first;
    }
  });
}

// A user's small language model: a vocabulary (7) that tp 2 and 3 do not
// divide, a padding index, and an MLP.
struct Lm : torch::nn::Module {
  Lm() {
    torch::manual_seed(13);
    embed = register_module("embed", torch::nn::Embedding(torch::nn::EmbeddingOptions(7, 6).padding_idx(3)));
    fc1 = register_module("fc1", torch::nn::Linear(6, 12));
    fc2 = register_module("fc2", torch::nn::Linear(12, 6));
    head = register_module("head", torch::nn::Linear(6, 7));
  }
  torch::Tensor forward(const torch::Tensor& ids) { return head(torch::tanh(fc2(torch::relu(fc1(embed(ids)))))); }
  torch::nn::Embedding embed{nullptr};
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, head{nullptr};
};

std::pair<torch::Tensor, torch::Tensor> lm_batch(int step) {
  torch::manual_seed(500 + step);
  return {torch::randint(7, {4, 5}, torch::kLong), torch::randint(7, {4, 5}, torch::kLong)};
}
torch::Tensor lm_loss(const torch::Tensor& logits, const torch::Tensor& targets) {
  return torch::cross_entropy_loss(logits.reshape({-1, 7}), targets.reshape({-1}));
}

const std::map<std::string, meshtrain::tp::Style> kLmPlan = {{"embed", meshtrain::tp::Style::kVocabParallel},
                                                             {"fc1", meshtrain::tp::Style::kColwise},
                                                             {"fc2", meshtrain::tp::Style::kRowwise}};

// The slice of the one-process parameter that tp rank r holds under kLmPlan.
torch::Tensor expected_lm_slice(const std::string& name, const torch::Tensor& full, int r, int n) {
  if (name == "embed.weight") {
    const auto rows = meshtrain::shard_range(full.size(0), n, r);
    return full.narrow(0, rows.offset, rows.size);
  }
  if (name == "fc1.weight" || name == "fc1.bias") return full.chunk(n, 0)[r];
  if (name == "fc2.weight") return full.chunk(n, 1)[r];
  return full;
}

// A plain Embedding made vocabulary parallel (rows split 4/3 and 3/2/2) with
// its MLP split too, at tp 2 and 3; then dp 2 x tp 2 with ZeRO-3 over dp.
TEST(UserModules, VocabParallelPlainEmbeddingMatchesOneProcess) {
  Reference ref;
  {
    Lm model;
    torch::optim::SGD opt(model.parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    for (int step = 0; step < kSteps; ++step) {
      auto [ids, targets] = lm_batch(step);
      opt.zero_grad();
      auto loss = lm_loss(model.forward(ids), targets);
      loss.backward();
      opt.step();
      ref.losses.push_back(loss.item<double>());
    }
    for (const auto& kv : model.named_parameters()) ref.params[kv.key()] = kv.value().detach().clone();
  }
  auto check = [&](const std::map<std::string, torch::Tensor>& params, const std::vector<double>& losses, int tp_rank,
                   int tp, const std::string& where) {
    for (size_t s = 0; s < losses.size(); ++s) EXPECT_NEAR(losses[s], ref.losses[s], 1e-5 * (1 + ref.losses[s])) << where << " step " << s;
    for (const auto& kv : params)
      EXPECT_TRUE(torch::allclose(kv.second, expected_lm_slice(kv.first, ref.params.at(kv.first), tp_rank, tp), 1e-4, 1e-6))
          << where << " parameter " << kv.first;
  };
  for (int tp : {2, 3}) {
    run_ranks(tp, [&](Communicator& comm) {
      Lm model;
      meshtrain::tp::parallelize(model, borrowed(comm), kLmPlan);
      EXPECT_EQ(model.embed->weight.size(0), meshtrain::shard_size(7, tp, comm.rank()));
      torch::optim::SGD opt(model.parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
      std::vector<double> losses;
      for (int step = 0; step < kSteps; ++step) {
        auto [ids, targets] = lm_batch(step);
        opt.zero_grad();
        auto loss = lm_loss(model.forward(ids), targets);
        loss.backward();
        opt.step();
        losses.push_back(loss.item<double>());
      }
      std::map<std::string, torch::Tensor> params;
      for (const auto& kv : model.named_parameters()) params[kv.key()] = kv.value();
      check(params, losses, comm.rank(), tp, "tp " + std::to_string(tp) + " rank " + std::to_string(comm.rank()));
    });
  }
  run_ranks(4, [&](Communicator& comm) {
    meshtrain::mesh::DeviceMesh mesh(borrowed(comm),
        meshtrain::mesh::MeshLayout(4, meshtrain::mesh::MeshDims().dp(2).tp(2)));
    Lm model;
    meshtrain::tp::parallelize(model, mesh.tp(), kLmPlan);
    meshtrain::zero::fully_shard(model, mesh.dp());
    torch::optim::SGD opt(meshtrain::zero::sharded_parameters(model), torch::optim::SGDOptions(0.1).momentum(0.9));
    std::vector<double> losses;
    for (int step = 0; step < kSteps; ++step) {
      auto [ids, targets] = lm_batch(step);
      const int64_t d = mesh.coord().dp;
      opt.zero_grad();
      auto loss = lm_loss(model.forward(ids.chunk(2, 0)[d]), targets.chunk(2, 0)[d]);
      loss.backward();
      opt.step();
      losses.push_back(mean_over(mesh.dp(), loss));
    }
    check(meshtrain::zero::full_parameters(model), losses, mesh.coord().tp, 2, "dp 2 x tp 2 rank " + std::to_string(comm.rank()));
  });
}

// A head tied to the embedding (GPT-2's): one unit holds the weight once,
// full_parameters gives it under both names, training matches one process;
// splitting the tie across two units is refused.
struct TiedLm : torch::nn::Module {
  TiedLm() : embed(nullptr) {
    torch::manual_seed(17);
    embed = register_module("embed", torch::nn::Embedding(9, 4));
    mix = register_module("mix", torch::nn::Linear(4, 4));
    head = register_parameter("head", embed->weight);
  }
  torch::Tensor forward(const torch::Tensor& ids) { return torch::matmul(torch::tanh(mix(embed(ids))), head.t()); }
  torch::nn::Embedding embed;
  torch::nn::Linear mix{nullptr};
  torch::Tensor head;
};

TEST(UserModules, FullyShardKeepsATiedWeightInOneUnit) {
  auto data = [](int step) {
    torch::manual_seed(600 + step);
    return std::make_pair(torch::randint(9, {4, 3}, torch::kLong), torch::randint(9, {4, 3}, torch::kLong));
  };
  auto loss_of = [](const torch::Tensor& logits, const torch::Tensor& t) {
    return torch::cross_entropy_loss(logits.reshape({-1, 9}), t.reshape({-1}));
  };
  std::vector<double> ref_losses;
  torch::Tensor ref_weight;
  {
    TiedLm model;
    std::vector<torch::Tensor> unique;  // libtorch lists the tied tensor twice: step it once
    for (const auto& p : model.parameters())
      if (std::none_of(unique.begin(), unique.end(), [&](const torch::Tensor& u) { return u.is_same(p); })) unique.push_back(p);
    torch::optim::SGD once(unique, 0.1);
    for (int step = 0; step < kSteps; ++step) {
      auto [ids, t] = data(step);
      once.zero_grad();
      auto loss = loss_of(model.forward(ids), t);
      loss.backward();
      once.step();
      ref_losses.push_back(loss.item<double>());
    }
    ref_weight = model.embed->weight.detach().clone();
  }
  run_ranks(2, [&](Communicator& comm) {
    {
      TiedLm split;
      meshtrain::zero::fully_shard(*split.embed, borrowed(comm));
      EXPECT_THROW(meshtrain::zero::fully_shard(split, borrowed(comm)), meshtrain::ConfigError);
    }
    TiedLm model;
    meshtrain::zero::fully_shard(model, borrowed(comm));
    torch::optim::SGD opt(model.parameters(), 0.1);
    for (int step = 0; step < kSteps; ++step) {
      auto [ids, t] = data(step);
      opt.zero_grad();
      auto loss = loss_of(model.forward(ids.chunk(2, 0)[comm.rank()]), t.chunk(2, 0)[comm.rank()]);
      loss.backward();
      opt.step();
      EXPECT_NEAR(mean_over(borrowed(comm), loss), ref_losses[step], 1e-5 * (1 + ref_losses[step])) << "step " << step;
    }
    const auto full = meshtrain::zero::full_parameters(model);
    EXPECT_TRUE(torch::allclose(full.at("embed.weight"), ref_weight, 1e-4, 1e-6));
    EXPECT_TRUE(torch::equal(full.at("head"), full.at("embed.weight")));
  });
}

TEST(UserModules, FullyShardTwiceNamesTheFix) {
  run_ranks(2, [](Communicator& comm) {
    auto model = std::make_shared<Net>();
    meshtrain::zero::fully_shard(*model, borrowed(comm));
    try {
      meshtrain::zero::fully_shard(*model->block, borrowed(comm));
      ADD_FAILURE() << "sharding an already sharded module gave no error";
    } catch (const meshtrain::ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("shard children first"), std::string::npos) << e.what();
    }
  });
}

}  // namespace

namespace {

// A head that reuses a weight it is given (a language model's tied embedding).
struct TiedHeadImpl : torch::nn::Module {
  explicit TiedHeadImpl(const torch::Tensor& shared) : weight(register_parameter("weight", shared)) {}
  torch::Tensor forward(const torch::Tensor& x) { return torch::matmul(x, weight.t()); }
  torch::Tensor weight;
};
TORCH_MODULE(TiedHead);

// A small language model whose head is tied to its embedding: 5 children,
// cut so that the two land on different pipeline ranks.
torch::nn::Sequential tied_model() {
  torch::manual_seed(7);
  torch::nn::Embedding embedding(10, 8);
  return torch::nn::Sequential(embedding, torch::nn::Linear(8, 8), torch::nn::Tanh(), torch::nn::Linear(8, 8),
                               TiedHead(embedding->weight));
}

torch::Tensor tokens(int step) {
  torch::manual_seed(200 + step);
  return torch::randint(0, 10, {12, 5}, torch::kLong);
}
torch::Tensor next_tokens(const torch::Tensor& t) { return (t + 1) % 10; }
torch::Tensor cross_entropy(const torch::Tensor& logits, const torch::Tensor& targets) {
  return torch::nn::functional::cross_entropy(logits.reshape({-1, 10}), targets.reshape({-1}));
}

Reference train_tied_one_process() {
  return train_reference(tied_model(), kSteps, 0.5, [](int step) {
    auto x = tokens(step);
    return std::make_pair(x, next_tokens(x));
  }, cross_entropy);
}

}  // namespace

// Note [Tied parameters across stages]: the embedding (stage 0) owns the
// weight the head (the last stage) reuses; trained as in one process on 2 and
// 3 stages, and on dp 2 x pp 2 under dp::replicate, ZeRO-2 and
// zero::fully_shard (the wrappers that shard gradients reduce the sum too).
TEST(UserModules, TiedEmbeddingAndHeadOnDifferentStagesMatchOneProcess) {
  const Reference ref = train_tied_one_process();
  ASSERT_TRUE(ref.params.count("4.weight") && ref.params.count("0.weight"));
  for (int stages : {2, 3}) {
    run_ranks(stages, [&](Communicator& comm) {
      auto stage = meshtrain::pp::pipeline(tied_model(), borrowed(comm), cross_entropy,
                                           meshtrain::pp::PipelineOptions().microbatches(3).split_points(
                                               stages == 2 ? std::vector<int64_t>{2} : std::vector<int64_t>{1, 3}));
      torch::optim::SGD opt(stage->parameters(), torch::optim::SGDOptions(0.5).momentum(0.9));
      const std::vector<double> losses = train_stage(stage, opt, tokens, next_tokens);
      expect_matches(ref, losses, *stage.module(), std::to_string(stages) + " stages, rank " + std::to_string(comm.rank()));
      // The head's copy of the weight holds the last step's start until sync_tied brings the owner's value.
      stage.sync_tied();
      if (stage.is_last()) {
        auto head = std::dynamic_pointer_cast<TiedHeadImpl>(stage->children().back());
        ASSERT_TRUE(head);
        EXPECT_TRUE(torch::allclose(head->weight, ref.params.at("4.weight"), 1e-5, 1e-6)) << "the copy after sync_tied";
      }
    });
  }
  for (const std::string wrapper : {"replicate", "zero2", "fully_shard", "fully_shard_bf16"}) {
    const bool bf16 = wrapper == "fully_shard_bf16";  // the head's copy computes in its owner's bf16
    run_ranks(4, [&](Communicator& comm) {
      meshtrain::mesh::DeviceMesh mesh(borrowed(comm),
          meshtrain::mesh::MeshLayout(4, meshtrain::mesh::MeshDims().dp(2).pp(2)));
      auto stage = meshtrain::pp::pipeline(tied_model(), mesh.pp(), cross_entropy,
                                           meshtrain::pp::PipelineOptions().split_points({2}).microbatches(2));
      // Only the owner (stage 0, the embedding) lists the tied weight.
      EXPECT_EQ(stage->named_parameters().contains("0.weight"), mesh.coord().pp == 0);
      EXPECT_FALSE(stage->named_parameters().contains("4.weight"));
      std::unique_ptr<meshtrain::zero::ZeroRedundancyOptimizer> zero2;
      std::optional<meshtrain::dp::Replicated<torch::nn::Module>> replicated;  // DDP lives as long as this
      if (wrapper == "replicate") replicated.emplace(meshtrain::dp::replicate(stage.module(), mesh.dp()));
      if (wrapper.rfind("fully_shard", 0) == 0) {
        meshtrain::zero::FullyShardOptions options;
        if (bf16) options.param_dtype(torch::kBFloat16);
        for (const auto& child : stage->children())
          if (!child->parameters().empty()) meshtrain::zero::fully_shard(*child, mesh.dp(), options);
      }
      auto sgd = std::make_unique<torch::optim::SGD>(stage->parameters(), torch::optim::SGDOptions(0.5).momentum(0.9));
      if (wrapper == "zero2")
        zero2 = std::make_unique<meshtrain::zero::ZeroRedundancyOptimizer>(stage.module(), std::move(sgd), mesh.dp(),
                                                                           meshtrain::zero::ZeroOptions().stage(2));
      torch::optim::Optimizer& opt = zero2 ? zero2->optimizer() : *sgd;
      std::vector<double> losses;
      for (int step = 0; step < kSteps; ++step) {
        auto mine = tokens(step).narrow(0, mesh.coord().dp * 6, 6);
        zero2 ? zero2->zero_grad() : opt.zero_grad();
        torch::Tensor loss = torch::tensor({stage.step(mine, next_tokens(mine))}, torch::kDouble);
        mesh.dp()->all_reduce(loss, meshtrain::comm::ReduceOp::kAvg);
        if (zero2) zero2->step();
        else opt.step();
        losses.push_back(loss.item<double>());
      }
      const std::string where = "dp 2 x pp 2 under " + wrapper + ", rank " + std::to_string(comm.rank());
      const double tolerance = bf16 ? 2e-2 : 1e-5;  // bf16: the float32 run's values to bf16's precision
      for (size_t s = 0; s < losses.size(); ++s)
        EXPECT_NEAR(losses[s], ref.losses[s], tolerance * (1 + ref.losses[s])) << where << " step " << s;
      std::map<std::string, torch::Tensor> got;  // the stage's parameters at full size, by name
      if (wrapper.rfind("fully_shard", 0) == 0) got = meshtrain::zero::full_parameters(*stage.module());
      if (zero2) got = zero2->consolidated_state(0).parameters;  // complete on dp rank 0
      if (wrapper == "replicate")
        for (const auto& kv : stage->named_parameters()) got[kv.key()] = kv.value();
      if (!zero2 || mesh.coord().dp == 0) {  // ZeRO-2 consolidates on dp rank 0
        EXPECT_FALSE(got.empty()) << where;
        for (const auto& kv : got) {
          EXPECT_TRUE(torch::allclose(kv.second, ref.params.at(kv.first), bf16 ? 2e-2 : 1e-4, bf16 ? 2e-2 : 1e-6))
              << where << " " << kv.first << ": largest difference "
              << (kv.second - ref.params.at(kv.first)).abs().max().item<double>();
        }
      }
      // fully_shard's registry holds the communicators to the end of the
      // process and the harness ends ranks with _Exit: a rank must not leave
      // while another still runs a collective (it would be seen to die).
      comm.barrier();
    });
  }
}

// Stages each rank built itself (PyTorch's PipelineStage, for a model too
// large to build whole everywhere): the last stage's head has a weight of its
// own, which PipelineOptions::tied declares a copy of the embedding's; trained
// like one process. A name a stage does not have is refused, naming it.
TEST(UserModules, PipelineOfStagesEachRankBuiltMatchesOneProcess) {
  const Reference ref = train_tied_one_process();
  const meshtrain::pp::TiedNames tied = {{{0, "0.weight"}, {1, "2.weight"}}};
  run_ranks(2, [&](Communicator& comm) {
    auto whole = tied_model();  // only for the initial values the one-process run starts from
    torch::nn::Sequential mine;
    std::shared_ptr<TiedHeadImpl> head;
    if (comm.rank() == 0) {
      for (int i : {0, 1}) mine->push_back(*(whole->begin() + i));  // embedding, Linear: "0.weight", "1.*"
    } else {
      for (int i : {2, 3}) mine->push_back(*(whole->begin() + i));   // Tanh, Linear: "1.*"
      head = std::make_shared<TiedHeadImpl>(torch::zeros({10, 8}));  // its own tensor: "2.weight"
      mine->push_back(TiedHead(head));
    }
    meshtrain::pp::Pipeline stage({meshtrain::pp::stage_module(mine)}, borrowed(comm), cross_entropy,
                                  meshtrain::pp::PipelineOptions().microbatches(3).tied(tied));
    EXPECT_FALSE(stage->named_parameters().contains("2.weight")) << "the copy is not the stage's to step";
    torch::optim::SGD opt(stage->parameters(), torch::optim::SGDOptions(0.5).momentum(0.9));
    const std::vector<double> losses = train_stage(stage, opt, tokens, next_tokens);
    const std::string where = "rank " + std::to_string(comm.rank());
    for (size_t s = 0; s < losses.size(); ++s) EXPECT_NEAR(losses[s], ref.losses[s], 1e-5 * (1 + ref.losses[s])) << where;
    stage.sync_tied();
    const auto params = stage->named_parameters();
    // This stage's names -> the whole model's.
    const std::map<std::string, std::string> whole_name =
        comm.rank() == 0 ? std::map<std::string, std::string>{{"0.weight", "0.weight"}, {"1.weight", "1.weight"}, {"1.bias", "1.bias"}}
                         : std::map<std::string, std::string>{{"1.weight", "3.weight"}, {"1.bias", "3.bias"}};
    EXPECT_EQ(params.size(), whole_name.size()) << where;
    for (const auto& kv : whole_name)
      EXPECT_TRUE(torch::allclose(params[kv.first], ref.params.at(kv.second), 1e-5, 1e-6)) << where << " " << kv.first;
    if (head) {
      EXPECT_TRUE(torch::allclose(head->weight, ref.params.at("4.weight"), 1e-5, 1e-6)) << "the copy after sync_tied";
    }
  });
  run_ranks(2, [&](Communicator& comm) {
    torch::nn::Sequential mine(torch::nn::Linear(8, 8));
    try {
      meshtrain::pp::Pipeline stage({meshtrain::pp::stage_module(mine)}, borrowed(comm), cross_entropy,
                                    meshtrain::pp::PipelineOptions().tied({{{0, "0.weight"}, {1, "0.wieght"}}}));
      if (comm.rank() == 1) ADD_FAILURE() << "a tied name the stage does not have was accepted";
    } catch (const meshtrain::ConfigError& e) {
      EXPECT_EQ(comm.rank(), 1);
      EXPECT_NE(std::string(e.what()).find("stage 1 has no parameter '0.wieght'"), std::string::npos) << e.what();
    }
  });
}

// tp::parallelize of an embedding whose weight the LM head reuses (tied): the
// head's logits hold each rank's vocabulary rows, the loss is
// tp::vocab_parallel_cross_entropy (the logits are never gathered), and the
// model trains like one process; the rest of the model stays dense.
TEST(UserModules, VocabParallelEmbeddingWithATiedHeadMatchesOneProcess) {
  const Reference ref = train_tied_one_process();
  run_ranks(2, [&](Communicator& comm) {
    auto model = tied_model();
    meshtrain::tp::parallelize(*model, borrowed(comm), {{"0", meshtrain::tp::Style::kVocabParallel}});
    std::vector<torch::Tensor> once;
    for (const auto& p : meshtrain::dp::unique_parameters(*model)) once.push_back(p.tensor);
    torch::optim::SGD opt(once, torch::optim::SGDOptions(0.5).momentum(0.9));
    std::vector<double> losses;
    for (int step = 0; step < kSteps; ++step) {
      auto x = tokens(step);
      opt.zero_grad();
      const torch::Tensor logits = model->forward(x);
      ASSERT_EQ(logits.size(-1), 5) << "the head's logits are this rank's half of the vocabulary";
      auto loss = meshtrain::tp::vocab_parallel_cross_entropy(logits.reshape({-1, 5}), next_tokens(x).reshape({-1}),
                                                              borrowed(comm));
      loss.backward();
      opt.step();
      losses.push_back(loss.item<double>());
    }
    for (int s = 0; s < kSteps; ++s) EXPECT_NEAR(losses[s], ref.losses[s], 1e-5 * (1 + ref.losses[s])) << "step " << s;
    for (const auto& kv : model->named_parameters()) {
      torch::Tensor want = ref.params.at(kv.key());
      if (kv.key() == "0.weight" || kv.key() == "4.weight") want = want.narrow(0, 5 * comm.rank(), 5);  // its rows
      EXPECT_TRUE(torch::allclose(kv.value(), want, 1e-5, 1e-6)) << kv.key() << " on rank " << comm.rank();
    }
  });
  // A vocabulary that tp does not divide cannot be cut evenly for the loss: refused, naming the fix.
  run_ranks(3, [&](Communicator& comm) {
    auto model = tied_model();
    try {
      meshtrain::tp::parallelize(*model, borrowed(comm), {{"0", meshtrain::tp::Style::kVocabParallel}});
      ADD_FAILURE() << "a tied head over 10 rows on tp 3 was accepted";
    } catch (const meshtrain::ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("shares its weight with '4.weight' (a tied LM head)"), std::string::npos)
          << e.what();
      EXPECT_NE(std::string(e.what()).find("pad the vocabulary to a multiple of 3"), std::string::npos) << e.what();
    }
  });
}

// What a tied parameter cannot go with is refused, not trained wrong: in
// tp::parallelize, the tied head also in the plan (it would be cut twice) and
// a head with a bias over the whole vocabulary.
TEST(UserModules, TiedParametersRefuseWhatTheyCannotFollow) {
  run_ranks(2, [&](Communicator& comm) {
    struct LinearHead : torch::nn::Module {  // a Linear whose forward uses the embedding's weight
      torch::nn::Embedding wte{register_module("wte", torch::nn::Embedding(8, 4))};
      torch::nn::Linear head{register_module("head", torch::nn::Linear(4, 8))};
      LinearHead() { head->weight = wte->weight; }
    };
    struct BiasedHead : torch::nn::Module {  // a tied head with a bias of the whole vocabulary
      torch::nn::Embedding wte{register_module("wte", torch::nn::Embedding(8, 4))};
      std::shared_ptr<torch::nn::Module> head = register_module("head", std::make_shared<torch::nn::Module>());
      BiasedHead() {
        head->register_parameter("weight", wte->weight);
        head->register_parameter("bias", torch::zeros({8}));
      }
    };
    auto refused = [&](torch::nn::Module& model, const std::map<std::string, meshtrain::tp::Style>& plan,
                       const std::string& says) {
      try {
        meshtrain::tp::parallelize(model, borrowed(comm), plan);
        ADD_FAILURE() << "accepted: " << says;
      } catch (const meshtrain::ConfigError& e) {
        EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
      }
    };
    LinearHead linear;
    refused(linear, {{"wte", meshtrain::tp::Style::kVocabParallel}, {"head", meshtrain::tp::Style::kColwise}},
            "'head' shares its weight with the kVocabParallel Embedding 'wte' (tied): leave it out of the plan");
    BiasedHead biased;
    refused(biased, {{"wte", meshtrain::tp::Style::kVocabParallel}}, "'head.bias' is a bias over the whole vocabulary");
  });
}

// A vocabulary tp does not divide is cut 3 / 2 / 2 rows (shard_range) at tp 3:
// tp::unshard gathers the parts of unequal size back into the dense weight,
// and tp::shard cuts a dense one the same way (checkpoints convert both ways).
TEST(UserModules, UnevenVocabularyConvertsBothWays) {
  run_ranks(3, [&](Communicator& comm) {
    torch::manual_seed(9);
    torch::nn::Sequential model(torch::nn::Embedding(7, 4), torch::nn::Linear(4, 6));
    const torch::Tensor dense = model[0]->as<torch::nn::EmbeddingImpl>()->weight.detach().clone();
    meshtrain::tp::parallelize(*model, borrowed(comm), {{"0", meshtrain::tp::Style::kVocabParallel},
                                                         {"1", meshtrain::tp::Style::kColwise}});
    const auto dims = meshtrain::tp::shard_dims(*model);
    std::map<std::string, torch::Tensor> local;
    for (const auto& kv : model->named_parameters()) local[kv.key()] = kv.value().detach();
    EXPECT_EQ(local.at("0.weight").size(0), comm.rank() == 0 ? 3 : 2);
    const auto full = meshtrain::tp::unshard(local, dims, comm);
    EXPECT_TRUE(torch::equal(full.at("0.weight"), dense)) << "rank " << comm.rank();
    EXPECT_EQ(full.at("1.weight").size(0), 6);
    const auto back = meshtrain::tp::shard(full, dims, comm.rank(), 3);
    for (const auto& kv : local) EXPECT_TRUE(torch::equal(back.at(kv.first), kv.second)) << kv.first;
  });
}
