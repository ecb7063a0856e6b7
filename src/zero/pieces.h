#pragma once
// What the ZeRO stages share (internal): this rank's shard pieces as tensors,
// the optimizer moved onto them, and consolidation / loading of full state.

#include <torch/optim/optimizer.h>

#include <functional>
#include <memory>
#include <vector>

#include "meshtrain/comm.h"
#include "meshtrain/dp.h"
#include "zero/layout.h"
#include "meshtrain/zero.h"

namespace meshtrain {
namespace zero {

struct Pieces {
  std::vector<ShardPiece> pieces;
  std::vector<at::Tensor> values;  // 1-D views of this rank's parameter values, one per piece
  // Points each piece's .grad at grads(piece) and hands the pieces to the
  // optimizer, keeping each parameter's group.
  void attach(torch::optim::Optimizer& optimizer, const std::vector<dp::NamedParam>& params,
              const std::function<at::Tensor(const ShardPiece&)>& grads);
  int64_t optimizer_bytes(torch::optim::Optimizer& optimizer) const;
  // Each piece's gradient (what the optimizer steps) under its parameter's name.
  std::vector<std::pair<std::string, at::Tensor>> gradients(const std::vector<dp::NamedParam>& params) const;

  // Mixed precision: `values` are float32 masters of pieces that the module
  // holds in a lower precision; `low_grads` are the pieces' gradients there.
  std::vector<at::Tensor> low_grads;
  // Before the optimizer step: float32 copies of low_grads become the masters'
  // gradients (for this step only).
  void masters_take_gradients();
  // After it: the masters into `buffer` (the module's flat parameters, in
  // their precision) at each piece's flat offset; gradients dropped.
  void masters_into(at::Tensor buffer);
  // The float32 shard of `shard_numel` elements made of the masters (for consolidation).
  at::Tensor masters_shard(int64_t shard_numel) const;
  int64_t master_bytes() const;
};

// Full parameter-shaped tensors on `root` from every rank's shard buffer (the
// concatenation of its pieces' values in layout order); empty elsewhere.
std::vector<at::Tensor> gather_full(comm::Communicator& comm, const Layout& layout, const at::Tensor& my_shard,
                                    const std::vector<dp::NamedParam>& params, int root);

// The optimizer part of a FullState, gathered from the pieces.
std::map<std::string, std::map<std::string, at::Tensor>> consolidate_optimizer(
    comm::Communicator& comm, const Layout& layout, const Pieces& pieces, torch::optim::Optimizer& optimizer,
    const std::vector<dp::NamedParam>& params, int root);

// This rank's pieces with their optimizer state, by parameter name.
std::vector<OwnedPiece> owned_pieces(const Pieces& pieces, torch::optim::Optimizer& optimizer,
                                     const std::vector<dp::NamedParam>& params);

// Loads this rank's pieces of `state` (values and optimizer state).
void load_pieces(const FullState& state, const Pieces& pieces, torch::optim::Optimizer& optimizer,
                 const std::vector<dp::NamedParam>& params);

}  // namespace zero
}  // namespace meshtrain
