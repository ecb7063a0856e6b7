#pragma once
// Sharded, atomic checkpoints that load under any layout.
//
// Saving: every rank writes only what it owns — its parameters (one replica
// per data-parallel group), its shard of the optimizer state, its RNG state —
// as chunks in layout-independent coordinates (parameter, kind, the tp slab of
// the full tensor, a flat offset within it). See Note [Atomic checkpoints] in
// checkpoint.cpp for the commit protocol: a checkpoint is complete only once
// its manifest (layout, step, SHA-256 of every shard) has been renamed into
// place, and `latest` only ever names complete checkpoints.
//
// Loading: each rank reads, from whichever shards hold them, the full tensors
// of the parameters it holds under the *new* layout, verifying every shard's
// checksum, and takes its part: dp, tp, pp and the ZeRO stage may all differ
// from the saving run's.

#include <ATen/core/Tensor.h>

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "meshtrain/comm/communicator.h"
#include "meshtrain/util/json.h"
#include "meshtrain/util/rng.h"

namespace meshtrain {
namespace train {

// One piece of training state in layout-independent coordinates.
struct StateChunk {
  std::string param;  // the single-process model's parameter name
  std::string kind;   // "value", or an optimizer state ("exp_avg", "exp_avg_sq", "momentum_buffer", ...)
  std::vector<int64_t> full_shape;
  int64_t tp_dim = -1;  // the full tensor is cut into tp_size slabs along tp_dim (-1: not cut)
  int tp_index = 0;
  int tp_size = 1;
  int64_t offset = 0;  // flat offset of `data` within its slab
  at::Tensor data;     // 1-D
};

// What one rank writes.
struct RankState {
  std::vector<StateChunk> chunks;
  std::map<std::string, int64_t> steps;  // optimizer step counts by parameter
  at::Tensor rng_state;                  // libtorch's CPU generator (cpu_rng_state()); undefined: none
};

// The default CPU generator's state (torch.get_rng_state()) and its restore.
using meshtrain::cpu_rng_state;  // util/rng.h
using meshtrain::set_cpu_rng_state;

struct SaveStats {
  double seconds = 0;  // the training loop was blocked this long
  int64_t bytes = 0;   // this rank's shard
};

// Collective over `comm` (every rank of the job): writes step-NNNNNNNN/ in dir
// and commits it. Throws on every rank if any rank failed to write. Each shard
// is a torch.save archive of a dict of 1-D tensors ("c0", "c1", ..., "rng"),
// which PyTorch's `torch.load` opens; the manifest gives each key's coordinates
// (docs/checkpoints.md, tools/checkpoint_to_torch.py).
SaveStats save_checkpoint(const std::string& dir, int64_t step, const RankState& mine, comm::Communicator& comm,
                          const std::string& config_json);

// For saves in the background: a copy of the state at the step boundary
// (training may change the tensors afterwards) to hand to save_checkpoint on
// another thread, with its own communicator. The copy goes into the buffers of
// the previous one when the shapes match: faulting in fresh pages costs more
// than the copy itself. Valid until the next take().
class StateSnapshot {
 public:
  const RankState& take(const RankState& live);

 private:
  RankState copy_;
};

// The step directory `latest` names ("" when dir has no `latest`).
std::string latest_checkpoint(const std::string& dir);
// The step directories of `dir` that have a manifest (committed), newest first.
std::vector<std::string> complete_checkpoints(const std::string& dir);
// After a commit (one rank): removes committed checkpoints older than the
// newest `keep_last` (0: none), never the one `latest` names, and step
// directories without a manifest older than the newest committed one (left by
// a crash mid-save). Returns the directories removed.
std::vector<std::string> prune_checkpoints(const std::string& dir, int keep_last);
// Before a run's first save (one rank): removes every step directory without a
// manifest, which only a crashed save can have left (a kill -9 mid-write).
std::vector<std::string> remove_unfinished_saves(const std::string& dir);

class CheckpointReader {
 public:
  // Reads the manifest of a step directory. ConfigError when it is missing or malformed.
  explicit CheckpointReader(const std::string& step_dir);
  int64_t step() const { return step_; }
  const std::string& directory() const { return dir_; }
  const json::Value& config() const { return manifest_["config"]; }
  // The full tensor of (param, kind), assembled from the shards that hold it
  // (each verified against its SHA-256 on first use); undefined when absent.
  at::Tensor full(const std::string& param, const std::string& kind);
  std::optional<int64_t> optimizer_step(const std::string& param) const;
  // Reads every shard and checks its size and SHA-256 against the manifest
  // (without keeping it); ConfigError naming the first file that differs.
  void verify() const;
  bool has(const std::string& param) const;
  // The world size of the run that saved it, and the RNG state its rank
  // `rank` saved (undefined when that shard has none).
  int world_size() const { return static_cast<int>(manifest_["world_size"].i64()); }
  at::Tensor rng_state(int rank);

 private:
  const std::map<std::string, at::Tensor>& shard(size_t index);
  std::string dir_;
  json::Value manifest_;
  int64_t step_ = 0;
  std::map<size_t, std::map<std::string, at::Tensor>> loaded_;
  std::map<std::string, int64_t> steps_;
};

// Test hook: MESHTRAIN_CHECKPOINT_CRASH_AT=<stage> (with MESHTRAIN_CHECKPOINT_CRASH_RANK,
// default 0) kills the process with SIGKILL at that stage of a save: "shard-written",
// "shard-renamed", "manifest-written", "manifest-renamed", "latest-written";
// MESHTRAIN_CRASH_ONLY_AT_STEP restricts it to the save of one step.
void crash_point(const char* stage, int rank, int64_t step);

}  // namespace train
}  // namespace meshtrain
