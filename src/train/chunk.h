#pragma once
// The data-parallel part of train::Trainer, one per chunk (the module one
// pipeline stage runs, or the whole model): the chunk's wrapper along dp and
// the optimizer that steps what it holds (internal to train::Trainer):
//   whole  ZeRO 0: the parameters whole on every dp rank, DistributedDataParallel
//          when dp > 1; with param_dtype, bf16 parameters and fp32 masters
//          (train/mixed_precision.h) that the optimizer steps
//   zero   ZeRO-1/2: zero::ZeroRedundancyOptimizer
//   fsdp   ZeRO-3: zero::fully_shard on each child holding parameters (the
//          children of a ModuleDict or ModuleList each: the blocks), the
//          chunk's forward unchanged
// Each wrapper registers with dp/gradient_sync.h, so the pipeline's and the
// trainer's micro-batch loops pause its reduction without knowing which it is.

#include <map>
#include <memory>
#include <set>
#include <string>

#include "meshtrain/comm.h"
#include "meshtrain/train.h"

namespace meshtrain {
namespace train {

// Where a chunk's tensors sit in the full model: tp split dimensions by
// parameter name, this rank's tp slab, and its dp rank.
struct ShardPlace {
  std::map<std::string, int64_t> tp_dims;
  int tp_index = 0;
  int tp_size = 1;
  int dp_rank = 0;
  int dp_size = 1;
};

struct GrainGradient {
  at::Tensor tensor;
  at::ScalarType sum_dtype;
};

class ChunkTrainer {
 public:
  virtual ~ChunkTrainer() = default;
  virtual void zero_grad() = 0;
  virtual void step() = 0;
  virtual torch::optim::Optimizer& optimizer() = 0;
  // Parameters under their full names, on dp rank 0 (a collective over dp).
  virtual std::map<std::string, at::Tensor> parameters_on_dp_root() = 0;
  virtual StateBytes held() const = 0;
  // The gradients this rank's optimizer steps (after the step's last
  // backward), each marked counted once across the mesh (meshtrain/train.h).
  virtual std::vector<GradPart> gradient_parts(const ShardPlace& place) = 0;
  // Deterministic mode: the tensors holding what one micro-batch's backward
  // reduced (the gradients the optimizer steps, or their shards), and the
  // dtype the reduction summed in, which the grain tree sums in too
  // (Note [Deterministic training] in module_trainer.cpp). The same tensors,
  // in the same order, after every micro-batch of a step.
  virtual std::vector<GrainGradient> grain_gradients() = 0;
  // After the step's last backward, before gradient_parts and step: bf16-mixed
  // chunks copy their gradients to the fp32 masters.
  virtual void finish_gradients() {}
  // Checkpoints: this rank's share of the chunk's state (replicas are written
  // once: by dp rank 0, or by each rank for its ZeRO shard), and loading.
  virtual void add_to_checkpoint(RankState& out, const ShardPlace& place) = 0;
  virtual void load_checkpoint(CheckpointReader& reader, const ShardPlace& place) = 0;
  const std::shared_ptr<torch::nn::Module>& module() const { return module_; }

 protected:
  explicit ChunkTrainer(std::shared_ptr<torch::nn::Module> module) : module_(std::move(module)) {}
  std::shared_ptr<torch::nn::Module> module_;
};

// ZeRO-3's units in a chunk, by path: its children holding parameters (a
// ModuleDict's or ModuleList's children each).
std::vector<std::string> shard_unit_paths(const torch::nn::Module& chunk);

// `stepped_elsewhere`: parameters an earlier chunk of this rank steps (a tied
// weight two chunks share, without a wrapper along dp); the new chunk adds its own.
std::unique_ptr<ChunkTrainer> make_chunk_trainer(const TrainerOptions& options,
                                                 const Trainer::MakeOptimizer& make_optimizer,
                                                 std::shared_ptr<torch::nn::Module> chunk, comm::CommPtr dp,
                                                 std::set<const void*>& stepped_elsewhere);

// Expert parallelism's held-apart experts (train/experts.h), over their
// `replicas`: DDP under ZeRO 0, ZeRO-1 or 2 as the stage says, ZeRO-2 under
// ZeRO-3 (their weights stay whole: the module holding them never runs a
// forward of its own in which to gather them).
std::unique_ptr<ChunkTrainer> make_expert_chunk_trainer(const TrainerOptions& options,
                                                        const Trainer::MakeOptimizer& make_optimizer,
                                                        std::shared_ptr<torch::nn::Module> experts,
                                                        comm::CommPtr replicas);

}  // namespace train
}  // namespace meshtrain
