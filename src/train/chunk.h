#pragma once
// A model chunk (the pieces one pipeline stage holds, or the whole model) with
// its data-parallel wrapper and optimizer (internal to the trainer):
//   whole  dp == 1: the optimizer alone; dp > 1: DistributedDataParallel over
//          the dp communicator (either in fp32 or bf16-mixed)
//   zero   ZeRO stage 1 or 2 (ZeroRedundancyOptimizer)
//   fsdp   ZeRO stage 3 (zero::fully_shard), one unit per piece

#include <map>
#include <memory>
#include <optional>
#include <string>

#include "meshtrain/comm/communicator.h"
#include "meshtrain/models/models.h"
#include "meshtrain/train/checkpoint.h"
#include "meshtrain/train/clip.h"
#include "meshtrain/train/config.h"
#include "meshtrain/train/metrics.h"

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

class ChunkTrainer {
 public:
  virtual ~ChunkTrainer() = default;
  virtual at::Tensor forward(const at::Tensor& x) = 0;
  virtual void zero_grad() = 0;
  virtual void step() = 0;
  virtual torch::optim::Optimizer& optimizer() = 0;
  // Wraps one micro-batch's backward: whether gradients are synchronized now
  // (the last micro-batch of the step) or only accumulated.
  virtual void begin_backward(bool last_microbatch) = 0;
  virtual void end_backward() = 0;
  // Parameters under their full names, on dp rank 0 (a collective over dp).
  virtual std::map<std::string, at::Tensor> parameters_on_dp_root() = 0;
  virtual StateBytes held() const = 0;
  // The gradients this rank's optimizer steps (after the step's last
  // backward), each marked counted once across the mesh (train/clip.h).
  virtual std::vector<GradPart> gradient_parts(const ShardPlace& place) = 0;
  // After the step's last backward, before gradient_parts and step: bf16-mixed
  // chunks copy their gradients to the fp32 masters.
  virtual void finish_gradients() {}
  // Checkpoints: this rank's share of the chunk's state (replicas are written
  // once: by dp rank 0, or by each rank for its ZeRO shard), and loading.
  virtual void add_to_checkpoint(RankState& out, const ShardPlace& place) = 0;
  virtual void load_checkpoint(CheckpointReader& reader, const ShardPlace& place) = 0;
  models::Stage& stage() { return stage_; }

 protected:
  explicit ChunkTrainer(models::Stage stage) : stage_(std::move(stage)) {}
  models::Stage stage_;
};

// `keep_first_unit`: ZeRO-3 keeps the first piece gathered for the whole step
// (an embedding whose weight a tied head uses).
std::unique_ptr<ChunkTrainer> make_chunk_trainer(const TrainConfig& c, models::Stage stage, comm::CommPtr dp,
                                                 bool keep_first_unit);

}  // namespace train
}  // namespace meshtrain
