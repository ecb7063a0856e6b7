// Resuming and periodic checkpoints of a training run (see run_parts.h).
#include <ATen/ATen.h>

#include <chrono>
#include <cstdio>

#include "meshtrain/train/checkpoint.h"
#include "meshtrain/util/error.h"
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

Resumed resume_if_asked(const TrainConfig& c, Engine& engine, const comm::Communicator& world, bool verbose) {
  Resumed r;
  if (!c.resume) return r;
  MESHTRAIN_CHECK(!c.save_dir.empty(), "--resume needs --save-dir (where the checkpoints are)");
  const bool chief = verbose && world.rank() == 0;
  const std::string step_dir = latest_checkpoint(c.save_dir);
  if (step_dir.empty()) {
    if (chief) std::printf("no checkpoint in %s yet: starting from step 0\n", c.save_dir.c_str());
    return r;
  }
  const auto t0 = Clock::now();
  CheckpointReader reader(step_dir);
  engine.load_checkpoint(reader);
  restore_rng_state(reader, world, chief);
  r.first_step = reader.step();
  r.load_seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  if (chief) {
    std::printf("resumed from checkpoint step %lld (%s), loaded in %.3f s\n", static_cast<long long>(r.first_step),
                step_dir.c_str(), r.load_seconds);
  }
  MESHTRAIN_CHECK(r.first_step <= c.steps, "the checkpoint is at step ", r.first_step, ", past --steps ", c.steps);
  return r;
}

CheckpointSaver::CheckpointSaver(const TrainConfig& c, comm::CommPtr metrics, bool verbose)
    : c_(c), metrics_(std::move(metrics)), verbose_(verbose) {}

void CheckpointSaver::after_step(int64_t step, Engine& engine) {
  if (c_.save_dir.empty() || c_.save_every <= 0 || (step + 1) % c_.save_every != 0) return;
  RankState state = engine.checkpoint_state();
  state.rng_state = cpu_rng_state();
  const SaveStats s = save_checkpoint(c_.save_dir, step + 1, state, *metrics_, to_json(c_));
  seconds_ += s.seconds;
  bytes_ += s.bytes;
  ++saves_;
  if (verbose_ && metrics_->rank() == 0) {
    std::printf("checkpoint step %lld saved in %.3f s\n", static_cast<long long>(step + 1), s.seconds);
  }
}

std::string CheckpointSaver::json(const Resumed& resumed) const {
  at::Tensor all_bytes = at::tensor({bytes_}, at::kLong);
  metrics_->all_reduce(all_bytes);
  const int64_t total = all_bytes.item<int64_t>();
  return json::Object()
      .integer("resumed_from_step", resumed.first_step)
      .num("load_seconds", resumed.load_seconds)
      .integer("saves", saves_)
      .num("save_seconds", seconds_)
      .integer("save_bytes_all_ranks", total)
      .num("save_mb_per_s", seconds_ > 0 ? total / 1e6 / seconds_ : 0.0)
      .str();
}

}  // namespace train
}  // namespace meshtrain
