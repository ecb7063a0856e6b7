// Resuming and periodic checkpoints of a training run (see run_parts.h).
#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <utility>

#include "meshtrain/train.h"
#include "meshtrain/util.h"
#include "util/files.h"
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

// A checkpoint saved from another model or optimizer, or with another data
// order (the position in the data is step x global batch of the seeded
// permutation: another --global-batch or --seed would jump to other samples),
// is refused, unless --allow-config-change (then the differences are said).
void check_saved_config(const TrainConfig& c, const std::string& step_dir, bool chief) {
  const std::string saved = nlohmann::json::parse(files::read_all(step_dir + "/manifest.json"))["config"].dump();
  const std::string differ = config_differences(saved, to_json(c), "in the checkpoint", "now",
                                                {"model", "optimizer", "global_batch", "seed", "shuffle"});
  if (differ.empty()) return;
  MESHTRAIN_CHECK(c.allow_config_change, "--resume: ", step_dir, " was saved from another model, optimizer or data "
                  "order: ", differ, "; resume with the flags it was saved with, add --allow-config-change to change them ",
                  "deliberately, or use another --save-dir");
  if (chief) std::printf("resuming from %s with a changed configuration: %s\n", step_dir.c_str(), differ.c_str());
}

// --resume-fallback: the newest committed checkpoint that reads whole, each
// shard verified; what is skipped is said.
std::unique_ptr<CheckpointReader> newest_intact(const TrainConfig& c, std::vector<std::string> candidates, bool chief) {
  for (const std::string& step_dir : candidates) {
    try {
      auto reader = std::make_unique<CheckpointReader>(step_dir);
      reader->verify();
      check_saved_config(c, step_dir, chief);
      return reader;
    } catch (const ConfigError& e) {
      if (std::string(e.what()).rfind("--resume: ", 0) == 0) throw;
      if (chief) std::printf("--resume-fallback: skipping %s: %s\n", step_dir.c_str(), e.what());
    }
  }
  throw ConfigError(str_cat("--resume-fallback: no intact checkpoint in ", c.save_dir));
}

// The checkpoint to resume from: the one `latest` names (nullptr when the
// directory has no checkpoint yet). A missing or unreadable `latest` or a
// corrupt newest checkpoint is refused, naming it, unless --resume-fallback.
std::unique_ptr<CheckpointReader> checkpoint_to_resume(const TrainConfig& c, bool chief) {
  std::vector<std::string> candidates = complete_checkpoints(c.save_dir);
  std::string latest, latest_problem;
  try {
    latest = latest_checkpoint(c.save_dir);
    if (latest.empty()) latest_problem = "has no 'latest'";
  } catch (const ConfigError& e) {
    latest_problem = e.what();
  }
  if (latest.empty() && candidates.empty()) return nullptr;
  if (c.resume_fallback) {  // `latest` is one of the committed ones, or a newer one is complete too
    if (latest.empty() && chief) std::printf("--resume-fallback: %s %s\n", c.save_dir.c_str(), latest_problem.c_str());
    return newest_intact(c, candidates, chief);
  }
  MESHTRAIN_CHECK(!latest.empty(), "--resume: ", c.save_dir, " ", latest_problem, " but holds committed checkpoints ",
                  "(the newest: ", candidates.front(), "); add --resume-fallback to resume from the newest intact ",
                  "one, or use another --save-dir");
  try {
    auto reader = std::make_unique<CheckpointReader>(latest);
    check_saved_config(c, latest, chief);
    return reader;
  } catch (const ConfigError& e) {
    if (std::string(e.what()).rfind("--resume: ", 0) == 0) throw;
    throw ConfigError(str_cat("--resume: ", e.what(), "; add --resume-fallback to resume from the newest intact "
                              "checkpoint"));
  }
}

}  // namespace

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
  try {
    engine.load_checkpoint(*reader);  // a corrupt shard is found here: each is verified when first read
  } catch (const ConfigError& e) {
    if (c.resume_fallback) throw;
    throw ConfigError(str_cat(e.what(), "; add --resume-fallback to resume from the newest intact checkpoint"));
  }
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
  const bool saving = !c_.save_dir.empty();
  if (saving && c_.async_save) background_ = metrics_->split(0, metrics_->rank(), "checkpoint");  // every rank: same config
  if (saving) {  // what a crashed save left, before this run writes into the directory
    if (metrics_->rank() == 0 && files::exists(c_.save_dir)) remove_unfinished_saves(c_.save_dir);
    metrics_->barrier();
  }
}

CheckpointSaver::~CheckpointSaver() {
  if (writer_.joinable()) writer_.join();  // an error was raised already, or will not be: do not terminate
}

// Note [The last step is saved]: every --save-every steps, and always after the
// last step (a run of 160 steps with --save-every 60 ended at step 120 on disk,
// and `export --resume` then exported older weights without a word), as llm.c
// and torchtitan do; and at a stop asked for by SIGTERM (a preemption).
bool CheckpointSaver::due(int64_t step) const {
  if (c_.save_dir.empty()) return false;
  return step + 1 == c_.steps || (c_.save_every > 0 && (step + 1) % c_.save_every == 0);
}

bool CheckpointSaver::after_step(int64_t step, Engine& engine, bool stopping) {
  if (c_.save_dir.empty() || !(stopping || due(step))) return false;
  const auto t0 = Clock::now();
  if (background_) wait_for_writer();  // one save at a time
  RankState state = engine.checkpoint_state();
  state.rng_state = cpu_rng_state();
  if (!background_) {
    const SaveStats s = save_checkpoint(c_.save_dir, step + 1, state, *metrics_, to_json(c_));
    if (metrics_->rank() == 0) prune_checkpoints(c_.save_dir, c_.keep_last);
    seconds_ += s.seconds;
    bytes_ += s.bytes;
    ++saves_;
    if (verbose_ && metrics_->rank() == 0) {
      std::printf("checkpoint step %lld saved in %.3f s\n", static_cast<long long>(step + 1), s.seconds);
    }
    return true;
  }
  const RankState& snapshot = snapshot_.take(state);  // training may go on
  ++saves_;
  writing_step_ = step + 1;
  writer_ = std::thread([this, &snapshot, config = to_json(c_)] {
    try {
      written_ = save_checkpoint(c_.save_dir, writing_step_, snapshot, *background_, config);
      if (background_->rank() == 0) prune_checkpoints(c_.save_dir, c_.keep_last);
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
  return true;
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
