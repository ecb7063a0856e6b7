#pragma once
// The project's central test: a layout trains exactly like one process.
// expect_trains_like_one_process runs the trainer on `world` ranks (rank 0
// writes its losses and consolidated weights to the run's shared directory),
// runs the same configuration in this process on a world of one, and compares
// every step's loss and every final weight.

#include <chrono>
#include <map>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "harness.h"
#include "app/trainer/config.h"
#include "meshtrain/util.h"

namespace meshtrain {
namespace testing {

// Float32 training on different layouts differs only by the order in which
// sums are taken (all-reduce vs one batch reduction): a few ulps per step,
// which Adam's normalization magnifies a little over a few steps. Measured on
// the data-parallel matrix (tiny GPT, 4 steps): losses within 7e-7, weights
// within 8e-6; the bounds below leave a margin of about 5x, while a wrong
// gradient scale (sum instead of mean) already misses them by 1e-4 to 1e-2.
//
// Adam-family optimizers add one amplifier: an element whose gradient is
// near Adam's eps (1e-8) moves by lr * g / (|g| + eps), whose slope is lr/eps,
// so a reassociation error of 1e-10 in such a gradient moves the weight by up
// to about 1e-2 lr. Splitting a batch into many micro-batches (8) shows it:
// weights differ by up to 7e-5 at lr 1e-2 under AdamW while the same runs under
// SGD agree to 1e-8. The amplification is lr * (error of g) / eps and the
// error of a gradient element that cancels to ~0 scales with its summands, so
// no fixed multiple of lr bounds it on every CPU (an AVX-512 machine showed
// 1.03e-4 at lr 1e-2 with eps 1e-8). The tiny test configurations therefore
// use Adam eps 1e-6 (tiny_gpt, tiny_mlp), 100x less amplification; the
// weight tolerance for Adam-family optimizers is at least 1e-2 lr x (1e-8 /
// eps) (adam_weight_floor), below weight_atol at eps 1e-6. The losses stay tight, and every layout is also tested under SGD, where weights
// must agree to float rounding.
struct Tolerance {
  double loss_rtol = 2e-6;
  double loss_atol = 1e-6;
  double weight_rtol = 2e-4;
  double weight_atol = 2e-5;
  // The global gradient norm: a sum of squares taken in another order (and
  // gradients that differ by reassociation); a norm counting a replicated
  // parameter twice, or missing a shard, is off by far more.
  double grad_norm_rtol = 1e-5;
};

// The weight tolerance Adam's eps amplification needs (see Tolerance).
double adam_weight_floor(const train::TrainConfig& config);

// The one-process reference runs the global batch as one micro-batch, or as
// micro-batches of `reference_micro_batch` samples (gradient accumulation):
// what a mixture of experts with a capacity factor (routes dropped per
// forward) or under --aux-loss-scope micro (a balance loss per micro-batch)
// needs to see the same token sets as the layout's ranks.
void expect_trains_like_one_process(const train::TrainConfig& config, int world, const Tolerance& tol = {},
                                    const RankOptions& options = RankOptions(), int64_t reference_micro_batch = 0);

// `config` on one process: every axis 1, plain training, no recomputation,
// micro-batches of `micro_batch` samples (0: the global batch at once).
train::TrainConfig one_process(const train::TrainConfig& config, int64_t micro_batch = 0);

// What rank 0 of a run_training reported, handed back to the test process.
struct TrainOutput {
  int64_t first_step = 0;
  std::vector<double> losses;
  std::map<std::string, at::Tensor> parameters;
};
// Runs the trainer on `world` ranks (started with `options`) and returns rank 0's result.
TrainOutput train_on_ranks(const train::TrainConfig& config, int world, const RankOptions& options = RankOptions());
// The same in this process, on a world of one.
TrainOutput train_in_one_process(const train::TrainConfig& config);
// Runs the trainer on `world` ranks and returns its --metrics-out, parsed (in
// the test process; a null value inside the ranks or after a failure).
json::Value metrics_on_ranks(const train::TrainConfig& config, int world, const RankOptions& options = RankOptions());
// Expects the losses (from their first step on) and the parameters of `got` to
// match `want` within the tolerance (exact with a zero tolerance).
void expect_same_training(const TrainOutput& got, const TrainOutput& want, const Tolerance& tol, const std::string& what);

// A checkpoint directory per test, made by the parent and handed to the ranks
// in the configuration (the test body reruns in each rank with the same path:
// it is derived from the parent's pid, which the ranks see as their parent).
std::string checkpoint_dir(const std::string& test);

// A tiny GPT that trains in seconds on two cores with 8 ranks.
train::TrainConfig tiny_gpt();
train::TrainConfig tiny_mlp();
// tiny_gpt's sizes as a Llama with 2 key/value heads (grouped-query: under tp 2 one
// key/value head and two query heads per rank), untied.
train::TrainConfig tiny_llama();

}  // namespace testing
}  // namespace meshtrain
