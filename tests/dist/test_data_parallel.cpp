// DDP and the article's master DP train exactly like one process.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>

#include "equivalence.h"
#include "harness.h"
#include "meshtrain/dp.h"
#include "meshtrain/util.h"

using meshtrain::ConfigError;
using meshtrain::comm::Communicator;
using meshtrain::testing::expect_trains_like_one_process;
using meshtrain::testing::run_ranks;
using meshtrain::testing::tiny_gpt;
using meshtrain::testing::tiny_mlp;

namespace {

struct Case {
  std::string strategy;
  int world;
  std::string optimizer;
  bool accumulate;
};

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  return c.strategy + "_world" + std::to_string(c.world) + "_" + c.optimizer + (c.accumulate ? "_accum" : "");
}

class DataParallelEquivalence : public ::testing::TestWithParam<Case> {};

TEST_P(DataParallelEquivalence, GptMatchesOneProcess) {
  const Case& p = GetParam();
  auto c = tiny_gpt();
  c.strategy = p.strategy;
  c.optimizer = p.optimizer;
  if (p.optimizer == "sgd") c.momentum = 0.9;
  if (p.accumulate) c.micro_batch = c.global_batch / p.world / 2;  // two micro-batches per step
  expect_trains_like_one_process(c, p.world);
}

std::vector<Case> cases() {
  std::vector<Case> out;
  for (const char* s : {"ddp", "dp"})
    for (int w : {2, 3, 4})
      for (const char* o : {"sgd", "adamw"})
        for (bool a : {false, true}) out.push_back({s, w, o, a});
  return out;
}

INSTANTIATE_TEST_SUITE_P(Layouts, DataParallelEquivalence, ::testing::ValuesIn(cases()), case_name);

TEST(DataParallel, DdpBucketCapsFromOneParameterToOneBucket) {
  for (double cap : {1e-9, 0.001, 1000.0}) {
    auto c = tiny_gpt();
    c.bucket_cap_mb = cap;
    expect_trains_like_one_process(c, 3);
  }
  auto c = tiny_gpt();
  c.overlap = false;  // all-reduce after backward: same numbers
  expect_trains_like_one_process(c, 2);
}

TEST(DataParallel, MlpMatchesOneProcess) {
  for (const char* s : {"ddp", "dp"}) {
    auto c = tiny_mlp();
    c.strategy = s;
    expect_trains_like_one_process(c, 3);
  }
}

// The output layer's weight is the first layer's: one tensor registered in two
// submodules (the embedding/LM-head tie of language models).
struct TiedOut : torch::nn::Module {
  TiedOut(const torch::Tensor& shared) {
    weight = register_parameter("weight", shared);
    bias = register_parameter("bias", torch::zeros({6}));
  }
  torch::Tensor weight, bias;
};

// A user-defined module whose middle layer is used only on some ranks in some
// iterations, and whose first and last layers share (tie) one weight.
struct Branchy : torch::nn::Module {
  Branchy() {
    torch::manual_seed(7);
    a = register_module("a", torch::nn::Linear(6, 6));
    maybe = register_module("maybe", torch::nn::Linear(6, 6));
    out = register_module("out", std::make_shared<TiedOut>(a->weight));
  }
  torch::Tensor forward(const torch::Tensor& x, bool use_maybe) {
    auto h = torch::tanh(a->forward(x));
    if (use_maybe) h = h + torch::tanh(maybe->forward(h));
    return torch::nn::functional::linear(h, out->weight, out->bias);
  }
  torch::nn::Linear a{nullptr}, maybe{nullptr};
  std::shared_ptr<TiedOut> out;
};

bool uses_maybe(int rank, int step) { return step % 3 != 2 && (rank + step) % 2 == 0; }

torch::Tensor batch_of(int rank, int step) {
  torch::manual_seed(1000 * step + rank);
  return torch::randn({4, 6});
}

// DDP with unused and tied parameters against the same objective in one process:
// L = mean over ranks of each rank's loss.
// With two micro-batches the first runs under no_sync; the pattern of
// uses_maybe then leaves `maybe` used only in the accumulated micro-batch on
// some ranks, and unused everywhere in the synchronizing one (step 2).
// Twice: through DistributedDataParallel::forward(fn), which finds unused
// parameters after forward, and through dp::replicate with the module's own
// forward, which finds them at the end of backward.
TEST(DataParallel, UnusedAndTiedParametersMatchOneProcess) {
  for (bool replicated : {false, true})
  for (int micro : {1, 2}) {
    run_ranks(3, [micro, replicated](Communicator& comm) {
      const auto options = meshtrain::dp::DistributedDataParallelOptions().find_unused_parameters(true).bucket_cap_mb(1e-9);
      auto wrapped = meshtrain::dp::replicate(std::make_shared<Branchy>(),
                                              std::shared_ptr<Communicator>(&comm, [](Communicator*) {}), options);
      const std::shared_ptr<Branchy>& model = wrapped.module();
      meshtrain::dp::DistributedDataParallel& ddp = wrapped.ddp();
      torch::optim::SGD opt(wrapped->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
      auto ref = std::make_shared<Branchy>();
      torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
      const int n = comm.size();
      auto local_loss = [&](int k, int step) {
        const int i = step * micro + k;
        auto x = batch_of(comm.rank(), i);
        auto y = replicated ? wrapped->forward(x, uses_maybe(comm.rank(), i))
                            : ddp.forward([&] { return model->forward(x, uses_maybe(comm.rank(), i)); });
        return y.pow(2).mean() / micro;
      };
      for (int step = 0; step < 6; ++step) {
        {  // an evaluation between steps: no graph, so no backward follows and nothing is reduced
          at::NoGradGuard no_grad;
          ddp.forward([&] { return model->forward(batch_of(comm.rank(), 99), uses_maybe(comm.rank(), step)); });
        }
        opt.zero_grad();
        for (int k = 0; k < micro - 1; ++k) {
          auto guard = wrapped.no_sync();
          local_loss(k, step).backward();
        }
        local_loss(micro - 1, step).backward();
        opt.step();
        ref_opt.zero_grad();
        torch::Tensor total = torch::zeros({});
        for (int r = 0; r < n; ++r)
          for (int k = 0; k < micro; ++k) {
            const int i = step * micro + k;
            total = total + ref->forward(batch_of(r, i), uses_maybe(r, i)).pow(2).mean() / (n * micro);
          }
        total.backward();
        ref_opt.step();
        auto got = model->named_parameters(), want = ref->named_parameters();
        for (const auto& kv : want) {
          EXPECT_TRUE(torch::allclose(got[kv.key()], kv.value(), 1e-5, 1e-6))
              << "micro-batches " << micro << " step " << step << " parameter " << kv.key() << " rank "
              << comm.rank() << (replicated ? " (dp::replicate)" : " (forward(fn))");
        }
      }
    });
  }
}

TEST(DataParallel, UnusedParameterWithoutOptInIsAnErrorNamingIt) {
  run_ranks(2, [](Communicator& comm) {
    auto model = std::make_shared<Branchy>();
    meshtrain::dp::DistributedDataParallel ddp(model, std::shared_ptr<Communicator>(&comm, [](Communicator*) {}));
    auto y = ddp.forward([&] { return model->forward(torch::ones({2, 6}), /*use_maybe=*/false); });
    try {
      y.sum().backward();
      ADD_FAILURE() << "no error for an unused parameter";
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find("maybe.weight"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("find_unused_parameters"), std::string::npos) << e.what();
    }
  });
}

TEST(DataParallel, DifferentModelsAcrossRanksAreRejectedNamingTheParameter) {
  run_ranks(3, [](Communicator& comm) {
    auto model = std::make_shared<torch::nn::LinearImpl>(4, comm.rank() == 1 ? 3 : 2);
    try {
      meshtrain::dp::DistributedDataParallel ddp(model, std::shared_ptr<Communicator>(&comm, [](Communicator*) {}));
      ADD_FAILURE() << "no error";
    } catch (const ConfigError& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("weight"), std::string::npos) << msg;
      EXPECT_NE(msg.find("on ranks [1]"), std::string::npos) << msg;
      EXPECT_NE(msg.find("on ranks [0, 2]"), std::string::npos) << msg;
    }
  });
}

// BatchNorm's running statistics diverge in each rank's forward; every
// synchronizing backward ends with rank 0's on every rank, and under no_sync
// each rank keeps its own.
TEST(DataParallel, BuffersComeFromRankZeroAfterEachSynchronizingBackward) {
  run_ranks(3, [](Communicator& comm) {
    auto model = meshtrain::dp::replicate(torch::nn::BatchNorm1d(3), std::shared_ptr<Communicator>(&comm, [](Communicator*) {}));
    torch::manual_seed(comm.rank());
    auto x = torch::randn({5, 3}) + 10 * comm.rank();
    auto rank0_mean = [&] {
      auto mean = model->running_mean.clone();
      comm.broadcast(mean, 0);
      return mean;
    };
    {
      auto guard = model.no_sync();
      model->forward(x).pow(2).sum().backward();
    }
    const auto after_no_sync = rank0_mean();
    EXPECT_EQ(torch::equal(after_no_sync, model->running_mean), comm.rank() == 0) << "rank " << comm.rank();
    model->forward(x).pow(2).sum().backward();
    const auto after_sync = rank0_mean();
    EXPECT_TRUE(torch::equal(after_sync, model->running_mean)) << "rank " << comm.rank();
    EXPECT_FALSE(torch::equal(after_sync, after_no_sync));  // the statistics did move
  });
}

TEST(DataParallel, MasterDpGivesTheWholeBatchGradientOnRankZero) {
  run_ranks(3, [](Communicator& comm) {
    torch::manual_seed(3);
    auto model = std::make_shared<torch::nn::LinearImpl>(4, 2);
    auto ref = std::make_shared<torch::nn::LinearImpl>(4, 2);
    ref->weight.data().copy_(model->weight);
    ref->bias.data().copy_(model->bias);
    auto loss = [](const torch::Tensor& y, const torch::Tensor& t) { return torch::mse_loss(y, t); };
    meshtrain::dp::MasterDataParallel mdp(model, std::shared_ptr<Communicator>(&comm, [](Communicator*) {}), loss);
    torch::manual_seed(11);
    auto x = torch::randn({7, 4}), t = torch::randn({7, 2});  // 7 samples on 3 ranks: 3, 2, 2
    auto l = mdp.step(x, t, [&](const torch::Tensor& in) { return model->forward(in); });
    if (comm.rank() == 0) {
      auto want = loss(ref->forward(x), t);
      want.backward();
      EXPECT_NEAR(l.item<double>(), want.item<double>(), 1e-6);
      EXPECT_TRUE(torch::allclose(model->weight.grad(), ref->weight.grad(), 1e-5, 1e-7));
      EXPECT_TRUE(torch::allclose(model->bias.grad(), ref->bias.grad(), 1e-5, 1e-7));
    }
  });
}

}  // namespace

// A data-parallel group of a larger job (global ranks 1 and 2) whose ranks
// built different models: the error names the group's ranks and the job's.
TEST(DataParallel, DifferentModelsOnAGroupNameTheGlobalRanks) {
  run_ranks(3, [](Communicator& world) {
    const int r = world.rank();
    auto group = world.split(r >= 1 ? 0 : -1, r, "dp");
    if (!group) return;
    try {
      meshtrain::dp::replicate(torch::nn::Linear(3, r == 2 ? 5 : 4), group);
      ADD_FAILURE() << "no error for different models";
    } catch (const meshtrain::ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("on ranks [1] (global ranks [2])"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("on ranks [0] (global ranks [1])"), std::string::npos) << e.what();
    }
  });
}
