#pragma once
// meshtrain/zero.h: ZeRO-1/2 (ZeroRedundancyOptimizer) and ZeRO-3 (fully_shard, PyTorch's FSDP).
// Part of the public API (meshtrain/meshtrain.h includes it); the sections below
// are in dependency order.

#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "meshtrain/comm.h"
#include "meshtrain/dp.h"

// ===== zero =====
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
//   stage 3  zero::fully_shard (below): parameters partitioned too; a
//            unit's full parameters are all-gathered when its forward first
//            reads them and again in its backward, freed after use: 16Psi/N
//            plus the gathered units, 1.5x DDP's traffic.
//
// Shards follow zero/layout.h: parameters flat, cut into buckets (units for
// stage 3), every bucket split over the ranks (sizes need not divide).

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
  // gradient clipping: meshtrain/train.h).
  std::vector<std::pair<std::string, at::Tensor>> shard_gradients();
  HeldBytes held_bytes() const;
  torch::optim::Optimizer& optimizer();

 private:
  const torch::nn::Module* module_;  // for dp::set_gradient_sync (dp/gradient_sync.h)
  std::shared_ptr<ShardedCore> core_;
};

// ===== fully shard =====
// zero::fully_shard: ZeRO stage 3 (PyTorch's FSDP `fully_shard`) applied to a
// user's plain modules, the forward code left as it is:
//
//   for (auto& block : model->blocks) zero::fully_shard(*block, mesh.dp());
//   zero::fully_shard(*model, mesh.dp());                 // the rest: embeddings, head
//   torch::optim::AdamW adam(model->parameters(), 1e-3);  // now the shards
//   auto loss = loss_fn(model->forward(x), y);            // the module's own forward
//   loss.backward();                                      // gradients reduce-scattered here
//   adam.step();                                          // each rank steps its shard
//
// Each call makes one unit of the module's parameters that no earlier call
// took (shard children first, then the parent, as in PyTorch). A unit keeps
// one flat shard per rank, 1/N of its parameters (sizes need not divide). As
// with FSDP's flat parameters, the shard takes the parameters' place in the
// module's parameter list (registered as "_fully_sharded" in the module given
// to fully_shard), so module.parameters() is what an optimizer must step; the
// layers keep their parameter tensors at full shape, with their memory freed,
// and use them in forward as before. Names and full values: full_parameters.
// Between steps a rank holds 1/N of the parameters, gradients and optimizer
// state (ZeRO's 16 psi / N).
//
//   forward   the first operation that reads a unit's parameter all-gathers
//             the unit; the other gathered units of the same communicator are
//             freed then (reshard_after_forward), so about one unit is whole
//             at a time
//   backward  a unit is gathered again when its backward reads it; once all
//             its gradients are accumulated they are reduce-scattered
//             (averaged over the ranks) into the shard's .grad and the unit is
//             freed; at the end of backward every unit is freed, including
//             units whose parameters got no gradient (their shard gets zeros)
//   step      the optimizer changes the shards; a unit gathered before the
//             step is gathered again at its next use
//
// How, without forward hooks: the parameters carry a dispatch key libtorch
// 1.13 leaves unused (docs/design/forward-interception.md); tp::parallelize
// uses the same mechanism, and the two compose (a unit of tp slices). Every
// rank must run the same operations on sharded parameters, as it must call
// the same collectives: printing a parameter on one rank would gather on that
// rank alone (use full_parameters on every rank). Shard after Module::to(),
// which drops the key. Every rank must hold the same values to begin with:
// rank 0's are broadcast.
//
// Several backwards per step: each reduce-scatters, the shard's .grad adds
// them up; or dp::set_gradient_sync(module, false) (dp/gradient_sync.h; what
// pp::pipeline does between micro-batches) keeps full-size gradients in the
// parameters' .grad until a backward with sync on, for one reduce-scatter.
//
// Mixed precision (param_dtype, PyTorch's MixedPrecisionPolicy): the shard
// stays float32 (what the optimizer steps: the masters); the layers' parameters
// become bf16, units are gathered and their gradients reduce-scattered in bf16,
// and each reduced piece is added to the float32 shard's .grad. Bytes per rank:
// (4 + 4 + 8) psi / N with Adam, plus gathered units at 2 bytes per element.
// Float inputs must be cast to bf16 by the caller (no forward hook to do it).
//
// Sharded checkpoints: owned_pieces gives this rank's part of each parameter
// with its optimizer state (every rank writes only what it holds); load_state
// takes full values and state by name back into the shards, at any dp size.
//
// Not yet: prefetching the next unit (measured: on two cores the thread that
// would overlap the gather competes with the compute; docs/BENCHMARKS.md).

struct FullyShardOptions {
  // Free this unit when an operation starts on another unit (true), or keep it
  // gathered from its first use to the end of backward (false: the root's
  // embedding and head, used at both ends of the forward).
  TORCH_ARG(bool, reshard_after_forward) = true;
  // Compute and communicate in this dtype (at::kBFloat16); the shard keeps the
  // parameters' own dtype (float32 masters). nullopt: everything in that dtype.
  TORCH_ARG(c10::optional<at::ScalarType>, param_dtype) = c10::nullopt;
};

// Makes `module`'s not yet sharded parameters one unit over `dp`. Collective
// over dp (a broadcast from rank 0). Refused: a module with no such
// parameters, parameters that are views, and a weight tied to one an earlier
// call took (shard the modules sharing it in one call). tp::parallelize first.
void fully_shard(torch::nn::Module& module, const comm::CommPtr& dp, FullyShardOptions options = {});

// The flat shards of the units in `module`, in registration order (the
// sharded part of module.parameters(); one tensor per unit, so parameter
// groups per layer are not available).
std::vector<at::Tensor> sharded_parameters(const torch::nn::Module& module);

// Collective over dp: `module`'s parameters at full shape under their
// original names (sharded ones gathered, tied ones under each name; others
// as they are): for checkpoints and checks.
std::map<std::string, at::Tensor> full_parameters(const torch::nn::Module& module);

// `module`'s parameters as the model had them before sharding, under those
// names, each once (a tied one under its first name); sharded ones keep their
// full shape (an operation on one gathers its unit). The names FullState uses.
std::vector<dp::NamedParam> original_parameters(const torch::nn::Module& module);

// This rank's part of every sharded parameter of `module`, with its state in
// `optimizer` (which steps the shards): for sharded checkpoints. No communication.
std::vector<OwnedPiece> owned_pieces(const torch::nn::Module& module, torch::optim::Optimizer& optimizer);

// The shards' gradients as 1-D pieces by parameter name (for clipping:
// meshtrain/train.h); pieces of shards without a gradient are left out.
std::vector<std::pair<std::string, at::Tensor>> shard_gradients(const torch::nn::Module& module);

// Collective over dp: full values and optimizer state of `module` by
// parameter name, at full shape, on every rank (a consolidated checkpoint:
// load it into any layout with load_state or ZeroRedundancyOptimizer).
FullState full_state(const torch::nn::Module& module, torch::optim::Optimizer& optimizer);

// Loads full values and optimizer state (by original_parameters' names, at
// full shape; "step" a scalar) into this rank's shards and `optimizer`, and
// the module's unsharded parameters as they are. Every rank passes the same
// state; no communication. A parameter without some kind of optimizer state
// gets zeros (Adam's and momentum's start). Refuses a state that lacks a
// parameter or has another size for it.
void load_state(torch::nn::Module& module, torch::optim::Optimizer& optimizer, const FullState& state);

// The most bytes of gathered units (sharded parameters at full size) this
// process has held at once over `dp` since the first fully_shard on it.
int64_t peak_gathered_bytes(const comm::CommPtr& dp);

// Bytes of `module`'s parameters this rank holds now: the shards plus the
// storage of every gathered unit and of unsharded parameters.
int64_t held_parameter_bytes(const torch::nn::Module& module);

}  // namespace zero
}  // namespace meshtrain
