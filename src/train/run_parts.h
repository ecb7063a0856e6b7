#pragma once
// The parts of a training run around the step loop (internal to the trainer):
// resuming, periodic checkpoints, and the end-of-run report. run_training
// (trainer.cpp) is the step loop that calls them.

#include <memory>
#include <string>

#include "engine.h"
#include "meshtrain/comm/communicator.h"
#include "meshtrain/train/config.h"
#include "meshtrain/train/trainer.h"

namespace meshtrain {
namespace train {

// Where training starts: step 0, or the latest complete checkpoint under
// --save-dir with --resume (loaded into `engine` under this run's layout).
struct Resumed {
  int64_t first_step = 0;
  double load_seconds = 0;
};
Resumed resume_if_asked(const TrainConfig& c, Engine& engine, const comm::Communicator& world, bool verbose);

// Saves a checkpoint every --save-every steps and keeps the figures for the report.
class CheckpointSaver {
 public:
  CheckpointSaver(const TrainConfig& c, comm::CommPtr metrics, bool verbose);
  // Called after step `step` (0-based) on every rank.
  void after_step(int64_t step, Engine& engine);
  // The metrics' "checkpoint" object (a collective over the metrics communicator).
  std::string json(const Resumed& resumed) const;

 private:
  const TrainConfig& c_;
  comm::CommPtr metrics_;
  bool verbose_;
  double seconds_ = 0;
  int64_t bytes_ = 0, saves_ = 0;
};

// The last step's pipeline timeline: bubble and activations in flight as the
// metrics' "pipeline" object on rank 0 ("" elsewhere and without a pipeline),
// and the trace files of --trace. A collective.
std::string pipeline_report(const TrainConfig& c, const Engine& engine, const comm::Communicator& world,
                            comm::Communicator& metrics, bool verbose);

// Everything after the last step: the full parameters, the accuracy, every
// rank's memory and traffic, and on rank 0 the metrics JSON (--metrics-out),
// the loss plot and the summary lines. A collective.
void finish_run(const TrainConfig& c, Engine& engine, const comm::Communicator& world, comm::Communicator& metrics,
                const RunOptions& options, const std::string& checkpoint_json, const std::string& pipeline_json,
                TrainResult& result);

}  // namespace train
}  // namespace meshtrain
