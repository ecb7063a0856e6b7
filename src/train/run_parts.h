#pragma once
// The parts of a training run around the step loop (internal to the trainer):
// resuming, periodic checkpoints, and the end-of-run report. run_training
// (trainer.cpp) is the step loop that calls them.

#include <exception>
#include <memory>
#include <string>
#include <thread>

#include "engine.h"
#include "meshtrain/comm/communicator.h"
#include "meshtrain/train/config.h"
#include "meshtrain/train/trainer.h"

namespace meshtrain {
namespace train {

// Start-up checks (startup_checks.cpp), collectives over `world` raising
// ConfigError on every rank. check_same_data: every rank's copy of each
// --data / --val-data file has the same length and sampled content.
// check_save_dir: with --save-every or --resume, every rank sees the files the
// others write in --save-dir; without --resume a directory holding another
// run's checkpoints is refused, or emptied of them with --overwrite.
void check_same_data(const TrainConfig& c, comm::Communicator& world);
void check_save_dir(const TrainConfig& c, comm::Communicator& world);

// Where training starts: step 0, or the latest complete checkpoint under
// --save-dir with --resume (loaded into `engine` under this run's layout).
struct Resumed {
  int64_t first_step = 0;
  double load_seconds = 0;
};
Resumed resume_if_asked(const TrainConfig& c, Engine& engine, const comm::Communicator& world, bool verbose);

// Saves a checkpoint every --save-every steps and keeps the figures for the
// report. With --async-save the step boundary only encodes the shard (a
// copy); a writer thread writes, checksums and commits it on a communicator
// of its own, while training goes on. The next save, and finish(), wait for
// it; a failed background save raises there, on every rank.
class CheckpointSaver {
 public:
  CheckpointSaver(const TrainConfig& c, comm::CommPtr metrics, bool verbose);
  ~CheckpointSaver();
  // Called after step `step` (0-based) on every rank; whether it took a checkpoint.
  bool after_step(int64_t step, Engine& engine);
  // Waits for a save still being written (call after the last step).
  void finish();
  // The metrics' "checkpoint" object (a collective over the metrics communicator).
  std::string json(const Resumed& resumed) const;

 private:
  void wait_for_writer();

  const TrainConfig& c_;
  comm::CommPtr metrics_;
  bool verbose_;
  double seconds_ = 0;             // the training loop was blocked this long
  double background_seconds_ = 0;  // written and committed by the writer thread
  int64_t bytes_ = 0, saves_ = 0;
  comm::CommPtr background_;  // --async-save: the writer thread's communicator
  StateSnapshot snapshot_;    // --async-save: what the writer thread writes
  std::thread writer_;
  int64_t writing_step_ = 0;
  SaveStats written_;
  std::exception_ptr writer_error_;
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
