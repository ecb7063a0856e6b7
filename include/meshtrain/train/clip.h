#pragma once
// Global gradient-norm clipping for sharded and replicated gradients: what
// torch.nn.utils.clip_grad_norm_ computes on one process, on any layout.
//
// The norm is the L2 norm of the whole model's gradient with every element
// counted exactly once, wherever it lives: whole on every data-parallel
// replica (DDP: counted by dp rank 0), sharded over the data axis (ZeRO 1-3:
// each rank counts the reduced shard it steps), split over the tensor-parallel
// axis (column/row-parallel weights: every tp rank counts its slice) or
// replicated on it (layer norms, row-parallel biases: counted by tp rank 0),
// one pipeline stage each (a tied embedding is counted by the stage that owns
// it). Each rank sums the squares of the parts it counts; one all-reduce of a
// scalar over every rank that holds any part adds them; every rank then scales
// all of its parts, counted or not, by min(1, max_norm / (norm + 1e-6)), as
// PyTorch does. Squares are summed in float64.
//
//   // DDP or plain training, tensor-parallel layers included:
//   double norm = train::clip_grad_norm(*model, 1.0, mesh);
//   // ZeRO: the shards the optimizer steps
//   double norm = train::clip_grad_norm(
//       train::count_once(zero.shard_gradients(), tp::shard_dims(*model), false, mesh.coord()), 1.0, *mesh.world());

#include <torch/nn/module.h>

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "meshtrain/comm/communicator.h"
#include "meshtrain/mesh/mesh.h"

namespace meshtrain {
namespace train {

struct GradPart {
  at::Tensor grad;
  bool counted = true;  // false: another rank holds the same values and counts them
};

using NamedGrads = std::vector<std::pair<std::string, at::Tensor>>;

// The global norm of the counted parts over `group` (a collective: every rank
// of the group calls it, with or without parts). Scales every part when the
// norm exceeds max_norm; max_norm <= 0 only measures. Returns the norm before
// clipping (inf or nan when a gradient is not finite; then nothing is scaled).
double clip_grad_norm(const std::vector<GradPart>& parts, double max_norm, comm::Communicator& group);
// The same with the squares summed exactly (Note [Exact sum of squares] in
// util/exact_sum.h): the norm's bits do not depend on how the elements are
// split over ranks (train::TrainerOptions::deterministic). Float parts only.
double clip_grad_norm_exact(const std::vector<GradPart>& parts, double max_norm, comm::Communicator& group);

// Which of this rank's gradients (by parameter name) it counts: those split
// over tp (a dimension >= 0 in `tp_dims`, as tp::shard_dims gives) or on tp rank 0, and, when every dp rank holds
// the same values (`replicated_over_dp`), only on dp rank 0.
std::vector<GradPart> count_once(const NamedGrads& grads, const std::map<std::string, int64_t>& tp_dims,
                                 bool replicated_over_dp, const mesh::Coord& at);

// A module whose gradients are whole on every data-parallel rank (plain or DDP
// training, tensor-parallel layers included), on `mesh`.
double clip_grad_norm(const torch::nn::Module& module, double max_norm, const mesh::DeviceMesh& mesh);

}  // namespace train
}  // namespace meshtrain
