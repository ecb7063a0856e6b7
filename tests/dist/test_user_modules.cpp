// The strategies applied to a user's own modules (dp::replicate, pp::pipeline
// and both together) train exactly like one process.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "harness.h"
#include "meshtrain/comm/traffic.h"
#include "meshtrain/dp/replicate.h"
#include "meshtrain/mesh/mesh.h"
#include "meshtrain/pp/pipeline.h"
#include "meshtrain/util/error.h"

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
Reference train_one_process(int steps) {
  auto model = user_model();
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  Reference r;
  for (int step = 0; step < steps; ++step) {
    auto x = batch_inputs(step);
    opt.zero_grad();
    auto loss = mse(model->forward(x), batch_targets(x));
    loss.backward();
    opt.step();
    r.losses.push_back(loss.item<double>());
  }
  for (const auto& kv : model->named_parameters()) r.params[kv.key()] = kv.value().detach().clone();
  return r;
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

TEST(UserModules, PipelineOfASequentialMatchesOneProcess) {
  const Reference ref = train_one_process(kSteps);
  for (const char* schedule : {"gpipe", "1f1b"})
    for (int stages : {2, 3, 4}) {
      run_ranks(stages, [&](Communicator& comm) {
        auto stage = meshtrain::pp::pipeline(user_model(), borrowed(comm), mse,
                                             meshtrain::pp::PipelineOptions().schedule(schedule).microbatches(3));
        torch::optim::SGD opt(stage->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
        std::vector<double> losses;
        for (int step = 0; step < kSteps; ++step) {
          auto x = batch_inputs(step);
          opt.zero_grad();
          losses.push_back(stage.step(x, batch_targets(x)));
          opt.step();
        }
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
      meshtrain::mesh::DeviceMesh mesh(borrowed(comm), meshtrain::mesh::MeshLayout(comm.size(), dp, 2, 1));
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

}  // namespace
