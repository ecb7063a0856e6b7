#pragma once
// The trainer: runs the configured layout on the built-in models and reports
// what a user needs to compare layouts: per-step global-batch losses,
// throughput, memory per rank, traffic per rank and operation, and the task
// accuracy. `meshtrain` (tools/meshtrain) is a thin main() around run_training.

#include <limits>
#include <map>
#include <string>
#include <vector>

#include "meshtrain/comm.h"
#include "app/trainer/config.h"
#include "app/trainer/device_peak.h"

namespace meshtrain {
namespace train {

struct RunOptions {
  bool verbose = true;    // progress lines and the final report on rank 0
  bool evaluate = true;   // task accuracy at the end
};

struct TrainResult {
  int64_t first_step = 0;          // > 0 after resuming from a checkpoint
  // Stopped after a checkpoint because a node waits to join the elastic job
  // (app/trainer/elastic.h): the program should exit with launch::kRegroupExitCode.
  bool stopped_for_regroup = false;
  // Stopped at a step's end by SIGTERM (stop_at_step_end_on_sigterm), after
  // saving a checkpoint: the program should exit with 128 + SIGTERM.
  bool stopped_by_signal = false;
  std::vector<double> losses;      // global-batch loss of steps first_step, first_step + 1, ... (every rank)
  std::vector<double> step_times;  // seconds
  std::vector<double> grad_norms;  // global gradient norm of each step, before clipping
  std::vector<double> learning_rates;  // of each step (the schedule's)
  std::vector<double> mfu;         // model FLOPs / step time / peak.flops, each step
  double model_flops_per_step = 0;  // forward and backward over the global batch
  JobPeak peak;                     // MFU's denominator and how it was obtained (Note [An honest MFU])
  // --experts: each step's routes per layer and expert over the global batch,
  // [layers, experts + 1] (the last column: routes dropped for capacity).
  std::vector<at::Tensor> router_load;
  // --eval-every: the held-out batch's loss after steps eval_steps (1-based), every rank.
  std::vector<int64_t> eval_steps;
  std::vector<double> eval_losses;
  double accuracy = std::numeric_limits<double>::quiet_NaN();
  // The full, unsharded parameters under the single-process model's names (rank 0).
  std::map<std::string, at::Tensor> full_parameters;
  std::string weights_sha256;  // weights_sha256(full_parameters) (rank 0)
  std::string metrics_json;  // rank 0
};

// SHA-256 (hex) of every parameter's float32 bytes, in name order: two runs
// (any layouts) ended with bit-identical weights exactly when these agree,
// without writing files. Other dtypes are converted to float32 first.
std::string weights_sha256(const std::map<std::string, at::Tensor>& parameters);

// Lets a SIGTERM that arrives while run_training trains with --save-dir stop
// it at the end of the step, with a checkpoint of that step, on every rank
// (Note [SIGTERM stops at a step's end] in app/trainer/stop_signal.cpp);
// elsewhere, and at a second SIGTERM, the process ends as it would without
// this. Call first thing in main(), before any thread starts.
void stop_at_step_end_on_sigterm();

// Runs training on `world` (every rank calls it). `config` must be resolved
// (train::resolve) for world->size() ranks.
TrainResult run_training(const TrainConfig& config, comm::CommPtr world, const RunOptions& options = {});

}  // namespace train
}  // namespace meshtrain
