// Resuming and periodic checkpoints of a training run (see run_parts.h).
#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <utility>

#include "meshtrain/train/checkpoint.h"
#include "meshtrain/util/error.h"
#include "meshtrain/util/files.h"
#include "meshtrain/util/json.h"
#include "run_parts.h"

namespace meshtrain {
namespace train {

namespace {

using Clock = std::chrono::steady_clock;

// Each rank takes back the generator state it saved. Under another world size
// rank r is not the saver's rank r: the generators keep their seeded state
// (meshtrain's models draw no random numbers while training: the data order is
// a function of seed and step, and they have no dropout).
void restore_rng_state(CheckpointReader& reader, const comm::Communicator& world, bool verbose) {
  if (reader.world_size() != world.size()) {
    if (verbose) {
      std::printf("checkpoint saved on %d ranks, resumed on %d: random generators keep their seeded state\n",
                  reader.world_size(), world.size());
    }
    return;
  }
  const at::Tensor state = reader.rng_state(world.rank());
  if (state.defined()) set_cpu_rng_state(state);
}

}  // namespace

// The checkpoint to resume from: the one `latest` names, or, when `latest` is
// gone or its manifest unreadable, the newest older complete one (said);
// refused when it was saved from another model or optimizer.
std::unique_ptr<CheckpointReader> checkpoint_to_resume(const TrainConfig& c, bool chief) {
  std::vector<std::string> candidates = complete_checkpoints(c.save_dir);
  const std::string latest = latest_checkpoint(c.save_dir);
  if (latest.empty() && !candidates.empty() && chief) {
    std::printf("%s has no 'latest' but committed checkpoints: resuming from the newest, %s\n", c.save_dir.c_str(),
                candidates.front().c_str());
  }
  if (!latest.empty()) {
    candidates.erase(std::remove(candidates.begin(), candidates.end(), latest), candidates.end());
    candidates.insert(candidates.begin(), latest);
  }
  for (size_t i = 0; i < candidates.size(); ++i) {
    try {
      auto reader = std::make_unique<CheckpointReader>(candidates[i]);
      const std::string saved = nlohmann::json::parse(files::read_all(candidates[i] + "/manifest.json"))["config"].dump();
      const std::string differ = config_differences(saved, to_json(c), "in the checkpoint", "now", {"model", "optimizer"});
      MESHTRAIN_CHECK(differ.empty(), "--resume: ", candidates[i], " was saved from another model or optimizer: ",
                      differ, "; resume with the flags it was saved with, or use another --save-dir");
      return reader;
    } catch (const ConfigError& e) {
      if (std::string(e.what()).rfind("--resume: ", 0) == 0 || i + 1 == candidates.size()) throw;
      if (chief) std::printf("cannot resume from %s (%s); trying the previous checkpoint\n", candidates[i].c_str(), e.what());
    }
  }
  return nullptr;
}

Resumed resume_if_asked(const TrainConfig& c, Engine& engine, const comm::Communicator& world, bool verbose) {
  Resumed r;
  if (!c.resume) return r;
  MESHTRAIN_CHECK(!c.save_dir.empty(), "--resume needs --save-dir (where the checkpoints are)");
  const bool chief = verbose && world.rank() == 0;
  const auto t0 = Clock::now();
  std::unique_ptr<CheckpointReader> reader = checkpoint_to_resume(c, chief);
  if (!reader) {
    if (chief) std::printf("no checkpoint in %s yet: starting from step 0\n", c.save_dir.c_str());
    return r;
  }
  engine.load_checkpoint(*reader);
  restore_rng_state(*reader, world, chief);
  r.first_step = reader->step();
  r.load_seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  if (chief) {
    std::printf("resumed from checkpoint step %lld (%s), loaded in %.3f s\n", static_cast<long long>(r.first_step),
                reader->directory().c_str(), r.load_seconds);
  }
  MESHTRAIN_CHECK(r.first_step <= c.steps, "the checkpoint is at step ", r.first_step, ", past --steps ", c.steps);
  return r;
}

CheckpointSaver::CheckpointSaver(const TrainConfig& c, comm::CommPtr metrics, bool verbose)
    : c_(c), metrics_(std::move(metrics)), verbose_(verbose) {
  const bool saving = !c_.save_dir.empty() && c_.save_every > 0;
  if (saving && c_.async_save) background_ = metrics_->split(0, metrics_->rank(), "checkpoint");  // every rank: same config
}

CheckpointSaver::~CheckpointSaver() {
  if (writer_.joinable()) writer_.join();  // an error was raised already, or will not be: do not terminate
}

void CheckpointSaver::after_step(int64_t step, Engine& engine) {
  if (c_.save_dir.empty() || c_.save_every <= 0 || (step + 1) % c_.save_every != 0) return;
  const auto t0 = Clock::now();
  if (background_) wait_for_writer();  // one save at a time
  RankState state = engine.checkpoint_state();
  state.rng_state = cpu_rng_state();
  if (!background_) {
    const SaveStats s = save_checkpoint(c_.save_dir, step + 1, state, *metrics_, to_json(c_));
    seconds_ += s.seconds;
    bytes_ += s.bytes;
    ++saves_;
    if (verbose_ && metrics_->rank() == 0) {
      std::printf("checkpoint step %lld saved in %.3f s\n", static_cast<long long>(step + 1), s.seconds);
    }
    return;
  }
  const RankState& snapshot = snapshot_.take(state);  // training may go on
  ++saves_;
  writing_step_ = step + 1;
  writer_ = std::thread([this, &snapshot, config = to_json(c_)] {
    try {
      written_ = save_checkpoint(c_.save_dir, writing_step_, snapshot, *background_, config);
    } catch (...) {
      writer_error_ = std::current_exception();
    }
  });
  const double blocked = std::chrono::duration<double>(Clock::now() - t0).count();
  seconds_ += blocked;
  if (verbose_ && metrics_->rank() == 0) {
    std::printf("checkpoint step %lld: snapshot in %.3f s, writing in the background\n", static_cast<long long>(step + 1),
                blocked);
  }
}

void CheckpointSaver::wait_for_writer() {
  if (!writer_.joinable()) return;
  writer_.join();
  if (writer_error_) std::rethrow_exception(std::exchange(writer_error_, nullptr));
  background_seconds_ += written_.seconds;
  bytes_ += written_.bytes;
  if (verbose_ && metrics_->rank() == 0) {
    std::printf("checkpoint step %lld committed (written in the background in %.3f s)\n",
                static_cast<long long>(writing_step_), written_.seconds);
  }
}

void CheckpointSaver::finish() { wait_for_writer(); }

std::string CheckpointSaver::json(const Resumed& resumed) const {
  at::Tensor all_bytes = at::tensor({bytes_}, at::kLong);
  metrics_->all_reduce(all_bytes);
  const int64_t total = all_bytes.item<int64_t>();
  return json::Object()
      .integer("resumed_from_step", resumed.first_step)
      .num("load_seconds", resumed.load_seconds)
      .integer("saves", saves_)
      .num("save_seconds", seconds_)
      .num("background_seconds", background_seconds_)
      .integer("save_bytes_all_ranks", total)
      .num("save_mb_per_s", seconds_ > 0 ? total / 1e6 / seconds_ : 0.0)
      .str();
}

}  // namespace train
}  // namespace meshtrain
