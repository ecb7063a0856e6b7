#include "equivalence.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdlib>
#include <unistd.h>

#include "harness.h"
#include "meshtrain/comm.h"
#include "app/trainer/run_training.h"
#include "util/files.h"
#include "util/tensor_io.h"

namespace meshtrain {
namespace testing {

// See Tolerance: with eps 1e-6 instead of torch's 1e-8, Adam amplifies
// reassociation errors 100x less, so weights can be compared tightly.
constexpr double kTestAdamEps = 1e-6;

double adam_weight_floor(const train::TrainConfig& config) {
  return 1e-2 * config.lr * (1e-8 / config.adam_eps);  // the amplification scales with 1 / eps
}

train::TrainConfig one_process(const train::TrainConfig& config, int64_t micro_batch) {
  train::TrainConfig single = config;
  single.dp = 0;
  single.pp = 1;
  single.tp = 1;
  single.cp = 1;
  single.ep = 1;
  single.zero = 0;
  single.strategy = "ddp";
  single.micro_batch = micro_batch;
  single.sequence_parallel = false;
  single.microbatches = 0;
  single.virtual_stages = 1;
  single.stage_boundaries.clear();
  single.activation_checkpointing = "none";  // recomputing must change nothing
  return single;
}

std::string checkpoint_dir(const std::string& test) {
  const int parent = in_rank_process() ? getppid() : getpid();
  const std::string dir = "/tmp/meshtrain-ckpt-" + std::to_string(parent) + "-" + test;
  if (!in_rank_process()) {
    std::system(("rm -rf " + dir).c_str());
    files::make_directories(dir);
  }
  return dir;
}

train::TrainConfig tiny_gpt() {
  train::TrainConfig c;
  c.model.kind = "gpt";
  c.model.vocab = 64;
  c.model.seq_len = 16;
  c.model.hidden = 32;
  c.model.heads = 4;
  c.model.layers = 3;
  c.global_batch = 24;
  c.steps = 4;
  c.lr = 1e-2;
  c.adam_eps = kTestAdamEps;  // see Tolerance
  c.eval_problems = 0;
  c.log_every = 1000;
  return c;
}

train::TrainConfig tiny_llama() {
  train::TrainConfig c = tiny_gpt();
  c.model.kind = "llama";
  c.model.kv_heads = 2;
  c.model.tie_embeddings = false;
  return c;
}

train::TrainConfig tiny_mlp() {
  train::TrainConfig c;
  c.model.kind = "mlp";
  c.model.features = 16;
  c.model.hidden = 32;
  c.model.classes = 5;
  c.model.layers = 4;
  c.global_batch = 24;
  c.steps = 4;
  c.lr = 1e-2;
  c.adam_eps = kTestAdamEps;  // see Tolerance
  c.eval_problems = 0;
  c.log_every = 1000;
  return c;
}

TrainOutput train_on_ranks(const train::TrainConfig& config, int world, const RankOptions& options) {
  train::RunOptions quiet;
  quiet.verbose = false;
  quiet.evaluate = false;
  RankRun run = run_ranks(world, [&](comm::Communicator& comm) {
    auto self = std::shared_ptr<comm::Communicator>(&comm, [](comm::Communicator*) {});
    train::TrainResult r = train::run_training(train::resolve(config, comm.size()), self, quiet);
    if (comm.rank() == 0) {
      auto out = r.full_parameters;
      out["__losses__"] = torch::tensor(r.losses, torch::kDouble);
      out["__first_step__"] = torch::tensor({r.first_step}, torch::kLong);
      save_tensors(shared_dir() + "/result.bin", out);
    }
  }, options);
  TrainOutput out;
  if (in_rank_process() || ::testing::Test::HasFailure()) return out;
  auto got = load_tensors(run.file("result.bin"));
  out.first_step = got.at("__first_step__").item<int64_t>();
  at::Tensor l = got.at("__losses__");
  for (int64_t i = 0; i < l.numel(); ++i) out.losses.push_back(l[i].item<double>());
  got.erase("__losses__");
  got.erase("__first_step__");
  out.parameters = got;
  return out;
}

json::Value metrics_on_ranks(const train::TrainConfig& config, int world, const RankOptions& options) {
  RankRun run = run_ranks(world, [&](comm::Communicator& comm) {
    auto self = std::shared_ptr<comm::Communicator>(&comm, [](comm::Communicator*) {});
    train::RunOptions quiet;
    quiet.verbose = false;
    quiet.evaluate = false;
    train::TrainConfig c = train::resolve(config, comm.size());
    c.metrics_out = shared_dir() + "/metrics.json";
    train::run_training(c, self, quiet);
  }, options);
  if (in_rank_process() || ::testing::Test::HasFailure()) return json::Value();
  return json::parse(files::read_all(run.file("metrics.json")));
}

TrainOutput train_in_one_process(const train::TrainConfig& config) {
  train::RunOptions quiet;
  quiet.verbose = false;
  quiet.evaluate = false;
  train::TrainResult r = train::run_training(train::resolve(config, 1), comm::make_single_process_world(), quiet);
  return TrainOutput{r.first_step, r.losses, r.full_parameters};
}

void expect_same_training(const TrainOutput& got, const TrainOutput& want, const Tolerance& tol, const std::string& what) {
  for (size_t i = 0; i < got.losses.size(); ++i) {
    const size_t step = got.first_step + i, j = step - want.first_step;
    ASSERT_LT(j, want.losses.size()) << what << ": step " << step << " missing from the reference";
    EXPECT_LE(std::abs(got.losses[i] - want.losses[j]), tol.loss_atol + tol.loss_rtol * std::abs(want.losses[j]))
        << what << ": step " << step << " loss " << got.losses[i] << " vs " << want.losses[j];
  }
  EXPECT_EQ(got.parameters.size(), want.parameters.size()) << what;
  for (const auto& kv : want.parameters) {
    auto it = got.parameters.find(kv.first);
    ASSERT_NE(it, got.parameters.end()) << what << ": parameter " << kv.first << " missing";
    const double excess = ((it->second - kv.second).abs() - (tol.weight_atol + tol.weight_rtol * kv.second.abs())).max().item<double>();
    EXPECT_LE(excess, 0.0) << what << ": parameter " << kv.first << " differs by "
                           << (it->second - kv.second).abs().max().item<double>();
  }
}

void expect_trains_like_one_process(const train::TrainConfig& config, int world, const Tolerance& given,
                                    const RankOptions& options, int64_t reference_micro_batch) {
  Tolerance tol = given;
  if (config.optimizer != "sgd") tol.weight_atol = std::max(tol.weight_atol, adam_weight_floor(config));
  train::RunOptions quiet;
  quiet.verbose = false;
  quiet.evaluate = false;
  RankRun run = run_ranks(world, [&](comm::Communicator& comm) {
    auto self = std::shared_ptr<comm::Communicator>(&comm, [](comm::Communicator*) {});
    const train::TrainConfig resolved = train::resolve(config, comm.size());
    train::TrainResult r = train::run_training(resolved, self, quiet);
    if (comm.rank() == 0) {
      auto out = r.full_parameters;
      out["__losses__"] = torch::tensor(r.losses, torch::kDouble);
      out["__grad_norms__"] = torch::tensor(r.grad_norms, torch::kDouble);
      out["__eval_losses__"] = torch::tensor(r.eval_losses, torch::kDouble);
      save_tensors(shared_dir() + "/result.bin", out);
    }
  }, options);
  if (in_rank_process() || ::testing::Test::HasFailure()) return;

  train::TrainResult ref = train::run_training(train::resolve(one_process(config, reference_micro_batch), 1),
                                               comm::make_single_process_world(), quiet);
  auto got = load_tensors(run.file("result.bin"));
  at::Tensor losses = got.at("__losses__");
  ASSERT_EQ(losses.numel(), static_cast<int64_t>(ref.losses.size()));
  for (size_t s = 0; s < ref.losses.size(); ++s) {
    const double a = losses[s].item<double>(), b = ref.losses[s];
    EXPECT_LE(std::abs(a - b), tol.loss_atol + tol.loss_rtol * std::abs(b))
        << "step " << s << ": loss " << a << " on " << world << " ranks vs " << b << " in one process";
  }
  // --eval-every: the held-out loss, forward only, as one process computes it.
  at::Tensor evals = got.at("__eval_losses__");
  got.erase("__eval_losses__");
  ASSERT_EQ(evals.numel(), static_cast<int64_t>(ref.eval_losses.size()));
  for (size_t e = 0; e < ref.eval_losses.size(); ++e) {
    const double a = evals[e].item<double>(), b = ref.eval_losses[e];
    EXPECT_LE(std::abs(a - b), tol.loss_atol + tol.loss_rtol * std::abs(b))
        << "held-out loss after step " << ref.eval_steps[e] << ": " << a << " on " << world << " ranks vs " << b
        << " in one process";
  }
  // The global gradient norm (before clipping) counts every element once on any layout.
  at::Tensor norms = got.at("__grad_norms__");
  got.erase("__grad_norms__");
  ASSERT_EQ(norms.numel(), static_cast<int64_t>(ref.grad_norms.size()));
  for (size_t s = 0; s < ref.grad_norms.size(); ++s) {
    const double a = norms[s].item<double>(), b = ref.grad_norms[s];
    EXPECT_LE(std::abs(a - b), tol.grad_norm_rtol * b) << "step " << s << ": gradient norm " << a << " on " << world
                                                        << " ranks vs " << b << " in one process";
  }
  ASSERT_EQ(got.size() - 1, ref.full_parameters.size()) << "different parameter sets";
  double worst = 0, worst_abs = 0, worst_loss = 0;
  std::string worst_name;
  for (size_t s = 0; s < ref.losses.size(); ++s) worst_loss = std::max(worst_loss, std::abs(losses[s].item<double>() - ref.losses[s]));
  for (const auto& kv : ref.full_parameters) {
    auto it = got.find(kv.first);
    ASSERT_NE(it, got.end()) << "parameter " << kv.first << " missing from the distributed run";
    ASSERT_EQ(it->second.sizes(), kv.second.sizes()) << kv.first;
    const double excess = ((it->second - kv.second).abs() - (tol.weight_atol + tol.weight_rtol * kv.second.abs()))
                              .max().item<double>();
    if (excess > worst || worst_name.empty()) {
      worst = excess;
      worst_name = kv.first;
    }
    worst_abs = std::max(worst_abs, (it->second - kv.second).abs().max().item<double>());
    EXPECT_LE(excess, 0.0) << "parameter " << kv.first << " differs from one process by "
                           << (it->second - kv.second).abs().max().item<double>() << " (max abs) after "
                           << ref.losses.size() << " steps";
  }
  double worst_norm = 0;
  for (size_t s = 0; s < ref.grad_norms.size(); ++s)
    worst_norm = std::max(worst_norm, std::abs(norms[s].item<double>() / ref.grad_norms[s] - 1));
  std::cout << "equivalence on " << world << " ranks: max |loss diff| " << worst_loss << ", max |weight diff| "
            << worst_abs << ", max |norm / norm - 1| " << worst_norm << "\n";
}

}  // namespace testing
}  // namespace meshtrain
