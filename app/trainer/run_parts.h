#pragma once
// The parts of a training run around the step loop (internal to the trainer):
// resuming, periodic checkpoints, and the end-of-run report. run_training
// (trainer.cpp) is the step loop that calls them.

#include <exception>
#include <memory>
#include <string>
#include <thread>

#include "engine.h"
#include "meshtrain/comm.h"
#include "app/trainer/config.h"
#include "app/trainer/run_training.h"

namespace meshtrain {
namespace train {

// Start-up checks (startup_checks.cpp), collectives over `world` raising
// ConfigError on every rank. check_same_data: every rank's copy of each
// --data / --val-data file has the same length and sampled content (the
// whole content is proven later: Note [Input files are proven, then
// watched]). check_save_dir: with --save-dir, every rank sees the files the
// others write there, rank 0 holds the directory's lock for the job's life
// (Note [One job per save directory]; the returned object), and without
// --resume a directory holding another run's checkpoints is refused, or
// emptied of them with --overwrite. prepare_outputs: the directories of
// --metrics-out, --plot and --trace exist (rank 0 makes them), so that a run
// cannot fail at its end for want of one.
class SaveDirLock {
 public:
  SaveDirLock() = default;
  explicit SaveDirLock(int fd) : fd_(fd) {}
  SaveDirLock(SaveDirLock&& o) noexcept : fd_(o.fd_) { o.fd_ = -1; }
  SaveDirLock& operator=(SaveDirLock&& o) noexcept;
  ~SaveDirLock();

 private:
  int fd_ = -1;  // flock(2)ed; closing it releases the lock
};
void check_same_data(const TrainConfig& c, comm::Communicator& world);
SaveDirLock check_save_dir(const TrainConfig& c, comm::Communicator& world);
void prepare_outputs(const TrainConfig& c, comm::Communicator& world);

// Where training starts: step 0, or the latest complete checkpoint under
// --save-dir with --resume (loaded into `engine` under this run's layout).
struct Resumed {
  int64_t first_step = 0;
  double load_seconds = 0;
};
Resumed resume_if_asked(const TrainConfig& c, Engine& engine, const comm::Communicator& world, bool verbose);

// Saves a checkpoint every --save-every steps, after the last step and when
// the run stops early (`stopping`; Note [The last step is saved]), and keeps
// the figures for the report. With --async-save the step boundary only encodes the shard (a
// copy); a writer thread writes, checksums and commits it on a communicator
// of its own, while training goes on. The next save, and finish(), wait for
// it; a failed background save raises there, on every rank.
class CheckpointSaver {
 public:
  CheckpointSaver(const TrainConfig& c, comm::CommPtr metrics, bool verbose);
  ~CheckpointSaver();
  // Whether a checkpoint is due after step `step` (0-based).
  bool due(int64_t step) const;
  // Called after step `step` (0-based) on every rank; whether it took a
  // checkpoint (always, with --save-dir, when `stopping`).
  bool after_step(int64_t step, Engine& engine, bool stopping = false);
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
