// The equivalence matrix for a user's own module: a small GPT-like
// torch::nn::Sequential of plain layers (an embedding, attention + MLP blocks,
// a head tied to the embedding), trained by train::Trainer, which wraps it
// only with the public calls (tp::parallelize, pp::pipeline, dp::replicate /
// ZeroRedundancyOptimizer / zero::fully_shard), trains like one process on every dp x pp x tp layout
// of 2, 4 and 8 ranks the built-in matrix covers, with every ZeRO stage
// where dp > 1 and the pipeline schedules rotating, the global gradient norm
// clipped on every step.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdlib>
#include <optional>
#include <set>
#include <sstream>
#include <unistd.h>

#include "harness.h"
#include "meshtrain/dp.h"
#include "meshtrain/mesh.h"
#include "meshtrain/pp.h"
#include "meshtrain/train.h"
#include "meshtrain/tp.h"
#include "meshtrain/zero.h"

using meshtrain::comm::CommPtr;
using meshtrain::comm::Communicator;
using meshtrain::testing::run_ranks;
namespace dp = meshtrain::dp;
namespace pp = meshtrain::pp;
namespace tp = meshtrain::tp;
namespace zero = meshtrain::zero;

namespace {

constexpr int64_t kVocab = 16, kHidden = 16, kHeadDim = 2, kBlocks = 6, kBatch = 16, kSeq = 4;
constexpr int kSteps = 3;

// Attention and an MLP, the head count read from the tensor, so the forward
// runs unchanged on a tp rank's heads (8 heads of 2: tp up to 8).
struct Block : torch::nn::Module {
  Block() {
    for (const char* name : {"q", "k", "v", "out"}) layers.emplace(name, register_module(name, torch::nn::Linear(kHidden, kHidden)));
    fc1 = register_module("fc1", torch::nn::Linear(kHidden, 2 * kHidden));
    fc2 = register_module("fc2", torch::nn::Linear(2 * kHidden, kHidden));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    const int64_t B = x.size(0), T = x.size(1);
    auto heads = [&](const char* l) { return layers.at(l)(x).view({B, T, -1, kHeadDim}).transpose(1, 2); };
    auto scores = torch::softmax(torch::matmul(heads("q"), heads("k").transpose(-2, -1)), -1);
    auto h = x + layers.at("out")(torch::matmul(scores, heads("v")).transpose(1, 2).reshape({B, T, -1}));
    return h + fc2(torch::gelu(fc1(h)));
  }
  std::map<std::string, torch::nn::Linear> layers;
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};

struct TiedHead : torch::nn::Module {
  explicit TiedHead(const torch::Tensor& shared) : weight(register_parameter("weight", shared)) {}
  torch::Tensor forward(const torch::Tensor& x) { return torch::matmul(x, weight.t()); }
  torch::Tensor weight;
};

// 8 children: embedding, 6 blocks, the tied head (pp up to 8).
torch::nn::Sequential user_gpt() {
  torch::manual_seed(21);
  torch::nn::Embedding embedding(kVocab, kHidden);
  torch::nn::Sequential model(embedding);
  for (int b = 0; b < kBlocks; ++b) model->push_back(std::make_shared<Block>());
  model->push_back(std::make_shared<TiedHead>(embedding->weight));
  return model;
}

// The blocks' tensor-parallel plan: Megatron's cut of attention and MLP.
std::map<std::string, tp::Style> block_plan() {
  std::map<std::string, tp::Style> plan;
  for (int b = 1; b <= kBlocks; ++b) {
    const std::string p = std::to_string(b) + ".";
    for (const char* col : {"q", "k", "v", "fc1"}) plan[p + col] = tp::Style::kColwise;
    for (const char* row : {"out", "fc2"}) plan[p + row] = tp::Style::kRowwise;
  }
  return plan;
}

// The slice of a one-process parameter that tp rank r of n holds under block_plan.
torch::Tensor tp_slice(const std::string& name, const torch::Tensor& full, int r, int n) {
  const std::string layer = name.substr(name.find('.') + 1, name.rfind('.') - name.find('.') - 1);
  const bool weight = name.size() > 7 && name.compare(name.size() - 7, 7, ".weight") == 0;
  if (name.find('.') == name.rfind('.')) return full;  // the embedding and the head: "0.weight", "7.weight"
  if (layer == "q" || layer == "k" || layer == "v" || layer == "fc1") return full.chunk(n, 0)[r];
  if ((layer == "out" || layer == "fc2") && weight) return full.chunk(n, 1)[r];
  return full;
}

torch::Tensor tokens(int step) {
  torch::manual_seed(300 + step);
  return torch::randint(0, kVocab, {kBatch, kSeq}, torch::kLong);
}
torch::Tensor next_tokens(const torch::Tensor& t) { return (t * 3 + 1) % kVocab; }
torch::Tensor cross_entropy(const torch::Tensor& logits, const torch::Tensor& targets) {
  return torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}), targets.reshape({-1}));
}

std::unique_ptr<torch::optim::Optimizer> make_sgd(std::vector<torch::Tensor> params) {
  return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(0.05).momentum(0.9));
}

std::unique_ptr<torch::optim::Optimizer> sgd(const torch::nn::Module& m) {
  std::vector<torch::Tensor> once;  // a tied parameter once (libtorch lists it under both names)
  for (const auto& p : dp::unique_parameters(m)) once.push_back(p.tensor);
  return make_sgd(once);
}

struct Reference {
  std::vector<double> losses, grad_norms;
  double held_out_loss = 0;  // the trained model's loss on a batch it never saw
  std::map<std::string, torch::Tensor> params;
};

// Small enough that every step clips (checked in the reference).
constexpr double kMaxNorm = 0.5;

Reference one_process() {
  Reference r;
  auto model = user_gpt();
  auto opt = sgd(*model);
  for (int step = 0; step < kSteps; ++step) {
    opt->zero_grad();
    auto x = tokens(step);
    auto loss = cross_entropy(model->forward(x), next_tokens(x));
    loss.backward();
    std::vector<torch::Tensor> once;
    for (const auto& p : dp::unique_parameters(*model)) once.push_back(p.tensor);
    r.grad_norms.push_back(torch::nn::utils::clip_grad_norm_(once, kMaxNorm));
    EXPECT_GT(r.grad_norms.back(), kMaxNorm) << "step " << step << " does not clip: the matrix would not test clipping";
    opt->step();
    r.losses.push_back(loss.item<double>());
  }
  for (const auto& kv : model->named_parameters()) r.params[kv.key()] = kv.value().detach().clone();
  const auto held_out = tokens(99);
  r.held_out_loss = cross_entropy(model->forward(held_out), next_tokens(held_out)).item<double>();
  return r;
}

struct Case {
  int dp, pp, tp, zero;
  std::string schedule;
  int world() const { return dp * pp * tp; }
  int virtual_stages() const { return schedule == "interleaved" ? 2 : 1; }
};

meshtrain::mesh::MeshDims dims_of(const Case& c) { return meshtrain::mesh::MeshDims().dp(c.dp).pp(c.pp).tp(c.tp); }

// Every layout of 2, 4 and 8 ranks, with every ZeRO stage where dp > 1; the
// schedules rotate (a layout with pp > 1 and dp > 1 runs each of them once).
std::vector<Case> cases() {
  std::vector<Case> out;
  const std::vector<std::string> schedules = {"1f1b", "gpipe", "interleaved", "naive"};
  int rotation = 0;
  for (int world : {2, 4, 8}) {
    for (int d = 1; d <= world; d *= 2) {
      for (int p = 1; d * p <= world; p *= 2) {
        for (int z = 0; z <= (d > 1 ? 3 : 0); ++z) {
          std::string schedule = p > 1 ? schedules[(rotation + z) % schedules.size()] : "1f1b";
          if (schedule == "interleaved" && 2 * p > kBlocks + 2) schedule = "1f1b";  // 8 children: V = 2 needs pp <= 4
          out.push_back({d, p, world / (d * p), z, schedule});
        }
        if (p > 1) ++rotation;
      }
    }
  }
  return out;
}

meshtrain::train::TrainerOptions trainer_options(const Case& c) {
  return meshtrain::train::TrainerOptions().zero(c.zero).tp_plan(block_plan())
      // Without a pipeline, 2 micro-batches: gradients accumulate, reduced on the last (ZeRO-2/3: each).
      .pipeline(pp::PipelineOptions().schedule(c.schedule).microbatches(c.pp > 1 ? c.pp : 2)
                    .virtual_stages(c.virtual_stages()))
      .zero_options(zero::ZeroOptions().bucket_cap_mb(0.001))  // several buckets
      .clip_grad_norm(kMaxNorm);
}

class UserMatrix : public ::testing::TestWithParam<Case> {};

TEST_P(UserMatrix, TrainsLikeOneProcess) {
  const Case c = GetParam();
  const Reference ref = one_process();
  meshtrain::testing::RankOptions options;
  options.time_limit = std::chrono::seconds(90);
  run_ranks(c.world(), [&](Communicator& comm) {
    meshtrain::mesh::DeviceMesh mesh(CommPtr(&comm, [](Communicator*) {}),
                                     meshtrain::mesh::MeshLayout(c.world(), dims_of(c)));
    const auto me = mesh.coord();
    meshtrain::train::Trainer trainer(user_gpt(), mesh, cross_entropy, make_sgd, trainer_options(c));
    const std::string where = "rank " + std::to_string(comm.rank());
    for (int step = 0; step < kSteps; ++step) {
      const auto x = tokens(step).chunk(c.dp, 0)[me.dp], y = next_tokens(x);
      const double loss = trainer.step(x, y);
      EXPECT_NEAR(loss, ref.losses[step], 1e-5 * (1 + ref.losses[step])) << where << " step " << step;
      EXPECT_NEAR(trainer.last_grad_norm(), ref.grad_norms[step], 1e-5 * ref.grad_norms[step]) << where << " step " << step;
    }
    const auto held_out = tokens(99).chunk(c.dp, 0)[me.dp];
    EXPECT_NEAR(trainer.evaluate(held_out, next_tokens(held_out)), ref.held_out_loss, 1e-5 * (1 + ref.held_out_loss))
        << where << " evaluate";
    const auto got = trainer.parameters_over_dp();
    for (const auto& kv : got) {
      ASSERT_TRUE(ref.params.count(kv.first)) << where << ": " << kv.first << " is not a parameter of the model";
      EXPECT_TRUE(torch::allclose(kv.second, tp_slice(kv.first, ref.params.at(kv.first), me.tp, c.tp), 1e-4, 1e-6))
          << where << " parameter " << kv.first;
    }
    // (A rank whose only child is the tied head holds no parameter of its own: a copy.)
    if (!dp::unique_parameters(*trainer.module()).empty() && me.dp == 0) {
      EXPECT_FALSE(got.empty()) << where << ": no parameters compared";
    }
    // Every parameter of the model was compared on some rank (the tied head's
    // weight is the embedding's: listed under "7.weight" only without a pipeline).
    std::string names;
    for (const auto& kv : got) names += kv.first + "\n";
    std::set<std::string> compared;
    for (const std::string& part : meshtrain::comm::all_gather_strings(comm, names)) {
      std::istringstream lines(part);
      for (std::string line; std::getline(lines, line);) compared.insert(line);
    }
    for (const auto& kv : ref.params) {
      if (kv.first == "7.weight") continue;
      EXPECT_TRUE(compared.count(kv.first)) << where << ": " << kv.first << " was not compared";
    }
    // The whole model on world rank 0: tp slices joined, every stage's parameters.
    const auto whole = trainer.full_parameters();
    if (comm.rank() == 0) {
      for (const auto& kv : ref.params) {
        if (kv.first == "7.weight") continue;  // the embedding's (tied)
        ASSERT_TRUE(whole.count(kv.first)) << where << ": full_parameters lacks " << kv.first;
        EXPECT_TRUE(torch::allclose(whole.at(kv.first), kv.second, 1e-4, 1e-6)) << where << " full " << kv.first;
      }
      // The tied head's weight is the embedding's (ZeRO-3 lists it under both names, the others once).
      EXPECT_EQ(whole.size() - whole.count("7.weight"), ref.params.size() - 1) << where;
    } else {
      EXPECT_TRUE(whole.empty()) << where;
    }
    // tp::parallelize's and fully_shard's registries hold the communicators to
    // the end of the process, and the harness ends a rank with _Exit, before
    // they would say goodbye: a rank whose dp group finished first must not
    // leave while another group still runs (the others would see it die).
    comm.barrier();
  }, options);
}

// A user's checkpoint (Trainer::checkpoint_state, train::save_checkpoint)
// loads under another layout: saved after one step on dp 2 x pp 2 under
// ZeRO-3 (the tied weight on its owner stage only), loaded on dp 2 x tp 2
// under ZeRO-1, whose next steps (SGD's momentum included) and final
// parameters match one process's.
TEST(UserTrainer, CheckpointLoadsUnderAnotherLayout) {
  const Reference ref = one_process();
  // The body reruns in each rank: the path comes from the parent's pid, which the ranks see as their parent's.
  const bool rank = meshtrain::testing::in_rank_process();
  const std::string dir = "/tmp/meshtrain-user-checkpoint-" + std::to_string(rank ? getppid() : getpid());
  if (!rank) std::system(("rm -rf " + dir + " && mkdir -p " + dir).c_str());
  meshtrain::testing::RankOptions options;
  options.time_limit = std::chrono::seconds(90);
  auto train = [&](const Case& c, int first_step, int end_step) {
    run_ranks(c.world(), [&](Communicator& comm) {
      meshtrain::mesh::DeviceMesh mesh(CommPtr(&comm, [](Communicator*) {}),
                                       meshtrain::mesh::MeshLayout(c.world(), dims_of(c)));
      meshtrain::train::Trainer trainer(user_gpt(), mesh, cross_entropy, make_sgd, trainer_options(c));
      if (first_step > 0) {
        meshtrain::train::CheckpointReader reader(meshtrain::train::latest_checkpoint(dir));
        ASSERT_EQ(reader.step(), first_step);
        trainer.load_checkpoint(reader);
      }
      for (int step = first_step; step < end_step; ++step) {
        const auto x = tokens(step).chunk(c.dp, 0)[mesh.coord().dp];
        EXPECT_NEAR(trainer.step(x, next_tokens(x)), ref.losses[step], 1e-5 * (1 + ref.losses[step])) << "step " << step;
      }
      if (first_step == 0) {
        meshtrain::train::save_checkpoint(dir, end_step, trainer.checkpoint_state(), comm, "{}");
      } else {
        const auto whole = trainer.full_parameters();
        for (const auto& kv : comm.rank() == 0 ? ref.params : std::map<std::string, torch::Tensor>{}) {
          if (kv.first == "7.weight") continue;  // the embedding's (tied)
          ASSERT_TRUE(whole.count(kv.first)) << kv.first;
          EXPECT_TRUE(torch::allclose(whole.at(kv.first), kv.second, 1e-4, 1e-6)) << kv.first;
        }
      }
      comm.barrier();  // the registries hold communicators to the end of the process (as above)
    }, options);
  };
  train({2, 2, 1, 3, "1f1b"}, 0, 1);
  train({2, 1, 2, 1, "1f1b"}, 1, kSteps);
  if (!rank) std::system(("rm -rf " + dir).c_str());
}

// Each chunk gets its own wrapper along dp: a tie between two chunks of one
// rank (pp 1, virtual stages) is refused when the trainer is made, naming it,
// under ZeRO-3 and under DDP alike; so is a keep_gathered path no stage holds.
TEST(UserTrainer, WhatItCannotDoIsRefusedWhenMade) {
  run_ranks(2, [&](Communicator& comm) {
    meshtrain::mesh::DeviceMesh mesh(CommPtr(&comm, [](Communicator*) {}),
        meshtrain::mesh::MeshLayout(2, meshtrain::mesh::MeshDims().dp(2)));
    auto refused = [&](meshtrain::train::TrainerOptions options, const std::string& message) {
      try {
        meshtrain::train::Trainer trainer(user_gpt(), mesh, cross_entropy, make_sgd, options);
        ADD_FAILURE() << "accepted; expected: " << message;
      } catch (const std::exception& e) {
        EXPECT_NE(std::string(e.what()).find(message), std::string::npos) << e.what();
      }
    };
    for (int z : {0, 3}) {
      refused(trainer_options({2, 1, 1, z, "interleaved"}), "parameter '7.weight' of chunk 1 is '0.weight' of chunk 0");
    }
    refused(trainer_options({2, 1, 1, 3, "1f1b"}).keep_gathered({"7.weigth"}), "keep_gathered path '7.weigth'");
    // A module inside a unit is no unit: keeping it gathered would do nothing.
    refused(trainer_options({2, 1, 1, 3, "1f1b"}).keep_gathered({"1.fc1"}), "keep_gathered path '1.fc1'");
    refused(trainer_options({2, 1, 1, 1, "1f1b"}).keep_gathered({"0"}), "keep_gathered applies to ZeRO-3");
    comm.barrier();
  });
}

// evaluate puts the model in eval mode (Dropout off) and back: the held-out
// loss is one process's in eval mode, and training goes on in training mode.
TEST(UserTrainer, EvaluateRunsInEvalMode) {
  auto make = [] {
    torch::manual_seed(8);
    return torch::nn::Sequential(torch::nn::Linear(6, 16), torch::nn::Dropout(0.5), torch::nn::Linear(16, 3));
  };
  torch::manual_seed(9);
  const torch::Tensor x = torch::randn({8, 6}), y = torch::randn({8, 3});
  auto mse = [](const torch::Tensor& out, const torch::Tensor& t) { return torch::mse_loss(out, t); };
  auto ref = make();
  ref->eval();
  const double expected = mse(ref->forward(x), y).item<double>();
  run_ranks(2, [&](Communicator& comm) {
    meshtrain::mesh::DeviceMesh mesh(CommPtr(&comm, [](Communicator*) {}),
        meshtrain::mesh::MeshLayout(2, meshtrain::mesh::MeshDims().dp(2)));
    auto sgd = [](std::vector<torch::Tensor> p) { return std::make_unique<torch::optim::SGD>(p, 0.1); };
    meshtrain::train::Trainer trainer(make(), mesh, mse, sgd, meshtrain::train::TrainerOptions().pipeline(
                                                                   pp::PipelineOptions().microbatches(2)));
    const double got = trainer.evaluate(x.chunk(2, 0)[comm.rank()], y.chunk(2, 0)[comm.rank()]);
    EXPECT_NEAR(got, expected, 1e-6);
    EXPECT_TRUE(trainer.module()->is_training()) << "evaluate left the model in eval mode";
    comm.barrier();
  });
}

// A stage the caller built that is one layer (its parameters its own, no
// children) is ZeRO-3's unit itself: trained, reduced and stepped like one
// process over 2 micro-batches.
TEST(UserTrainer, BuiltStageThatIsOneLayerTrainsUnderZero3) {
  auto make = [] {
    torch::manual_seed(5);
    return torch::nn::Linear(6, 3);
  };
  torch::manual_seed(6);
  const torch::Tensor x = torch::randn({8, 6}), y = torch::randn({8, 3});
  auto mse = [](const torch::Tensor& out, const torch::Tensor& t) { return torch::mse_loss(out, t); };
  auto ref = make();
  torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  std::vector<double> ref_losses;
  for (int step = 0; step < 3; ++step) {
    ref_opt.zero_grad();
    auto loss = mse(ref->forward(x), y);
    loss.backward();
    ref_opt.step();
    ref_losses.push_back(loss.item<double>());
  }
  run_ranks(2, [&](Communicator& comm) {
    meshtrain::mesh::DeviceMesh mesh(CommPtr(&comm, [](Communicator*) {}),
        meshtrain::mesh::MeshLayout(2, meshtrain::mesh::MeshDims().dp(2)));
    auto sgd = [](std::vector<torch::Tensor> p) {
      return std::make_unique<torch::optim::SGD>(p, torch::optim::SGDOptions(0.1).momentum(0.9));
    };
    meshtrain::train::Trainer trainer({pp::stage_module(make())}, mesh, mse, sgd,
                                      meshtrain::train::TrainerOptions().zero(3).pipeline(pp::PipelineOptions().microbatches(2)));
    for (int step = 0; step < 3; ++step) {
      const double loss = trainer.step(x.chunk(2, 0)[comm.rank()], y.chunk(2, 0)[comm.rank()]);
      EXPECT_NEAR(loss, ref_losses[step], 1e-6) << "step " << step;
    }
    const auto got = trainer.parameters_over_dp();
    if (comm.rank() == 0) {
      ASSERT_EQ(got.size(), 2u);
      EXPECT_TRUE(torch::allclose(got.at("weight"), ref->weight, 1e-5, 1e-6));
      EXPECT_TRUE(torch::allclose(got.at("bias"), ref->bias, 1e-5, 1e-6));
    }
    comm.barrier();
  });
}

INSTANTIATE_TEST_SUITE_P(Layouts, UserMatrix, ::testing::ValuesIn(cases()), [](const auto& info) {
  const Case& c = info.param;
  return "dp" + std::to_string(c.dp) + "_pp" + std::to_string(c.pp) + "_tp" + std::to_string(c.tp) + "_zero" +
         std::to_string(c.zero) + (c.pp > 1 ? "_" + c.schedule : "");
});

}  // namespace
