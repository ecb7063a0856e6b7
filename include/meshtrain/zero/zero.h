#pragma once
// ZeRO (arXiv 1910.02054) for any libtorch module and any elementwise
// torch::optim optimizer (SGD, Adam, AdamW, ...), with parameter groups.
//
//   stage 1  ZeroRedundancyOptimizer(stage 1): optimizer state partitioned.
//            Gradients are reduce-scattered (each rank gets the average of its
//            shard), each rank steps its shard, the updated parameters are
//            all-gathered: DDP's traffic, 8Psi + 8Psi/N bytes per rank (fp32 Adam).
//   stage 2  ZeroRedundancyOptimizer(stage 2): gradients partitioned too; each
//            bucket is reduce-scattered during backward as soon as it is full and
//            only the shard is kept: 4Psi + 12Psi/N.
//   stage 3  zero::fully_shard (fully_shard.h): parameters partitioned too; a
//            unit's full parameters are all-gathered when its forward first
//            reads them and again in its backward, freed after use: 16Psi/N
//            plus the gathered units, 1.5x DDP's traffic.
//
// Shards follow zero/layout.h: parameters flat, cut into buckets (units for
// stage 3), every bucket split over the ranks (sizes need not divide).

#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <map>
#include <memory>
#include <string>

#include "meshtrain/comm/communicator.h"

namespace meshtrain {
namespace zero {

// Training state gathered in full: parameters and per-parameter optimizer
// state ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "step"),
// by the module's parameter names. Loads into any stage and world size.
struct FullState {
  std::map<std::string, at::Tensor> parameters;
  std::map<std::string, std::map<std::string, at::Tensor>> optimizer;
};

// This rank's share of one parameter: the elements [offset, offset + numel)
// of the flattened parameter, their values and their optimizer state (for
// sharded checkpoints: every rank writes only what it owns).
struct OwnedPiece {
  std::string param;
  int64_t offset = 0;
  at::Tensor value;  // 1-D view
  std::map<std::string, at::Tensor> state;  // "exp_avg", ..., and "step"
};

// Bytes this rank holds (for the memory model).
struct HeldBytes {
  int64_t parameters = 0, gradients = 0, optimizer = 0, buffers = 0;
};

class ShardedCore;

struct ZeroOptions {
  TORCH_ARG(int, stage) = 1;  // 1 or 2; stage 3 is zero::fully_shard
  TORCH_ARG(double, bucket_cap_mb) = 25.0;
  // Reduce-scatter each bucket during backward (off: after backward).
  TORCH_ARG(bool, overlap) = true;
  // Mixed precision: the module's parameters and gradients, and the
  // reduce-scatter and all-gather, in this dtype (at::kBFloat16); the optimizer
  // steps float32 masters of this rank's shard, which checkpoints hold: the ZeRO
  // paper's (2 + 2) psi + 12 psi / N for stage 1, 2 psi + (2 + 12) psi / N for 2.
  TORCH_ARG(c10::optional<at::ScalarType>, param_dtype) = c10::nullopt;
};

class ZeroRedundancyOptimizer {
 public:
  // `optimizer` was built over `module`'s parameters (any parameter groups); from
  // now on it steps only this rank's shard. Parameters are broadcast from rank 0.
  ZeroRedundancyOptimizer(std::shared_ptr<torch::nn::Module> module,
                          std::unique_ptr<torch::optim::Optimizer> optimizer, comm::CommPtr comm,
                          ZeroOptions options = {});
  ~ZeroRedundancyOptimizer();
  ZeroRedundancyOptimizer(const ZeroRedundancyOptimizer&) = delete;
  ZeroRedundancyOptimizer& operator=(const ZeroRedundancyOptimizer&) = delete;

  void zero_grad();
  // Completes the gradient reduction, steps the shard, all-gathers the parameters.
  void step();
  // While alive, backward accumulates full gradients locally (gradient accumulation).
  class NoSync {
   public:
    explicit NoSync(ShardedCore* core);
    ~NoSync();
    NoSync(NoSync&& o) noexcept;

   private:
    ShardedCore* core_;
  };
  NoSync no_sync();

  FullState consolidated_state(int root = 0);  // collective; complete on root
  void load_state(const FullState& state);     // every rank passes the same state
  std::vector<OwnedPiece> owned_pieces();
  // This rank's reduced gradient shard, the one its optimizer steps, as 1-D
  // pieces by parameter name (complete after the step's last backward; for
  // gradient clipping: train/clip.h).
  std::vector<std::pair<std::string, at::Tensor>> shard_gradients();
  HeldBytes held_bytes() const;
  torch::optim::Optimizer& optimizer();

 private:
  const torch::nn::Module* module_;  // for dp::set_gradient_sync (dp/gradient_sync.h)
  std::shared_ptr<ShardedCore> core_;
};

}  // namespace zero
}  // namespace meshtrain
