#pragma once
// tp::parallelize: Megatron's tensor parallelism applied to a user's plain
// torch::nn::Linear layers, by their paths in the model, the forward code left
// as it is (torchtitan's parallelize_module with ColwiseParallel /
// RowwiseParallel):
//
//   tp::parallelize(*model, mesh.tp(), {{"block.fc1", tp::Style::kColwise},
//                                        {"block.fc2", tp::Style::kRowwise}});
//   auto y = model->forward(x);   // the user's forward, unchanged
//
//   kColwise  weight [out, in] keeps rows [r out/tp, (r+1) out/tp) and the
//             matching bias: the output holds this rank's out/tp features;
//             backward sums the input gradient over tp
//   kRowwise  weight keeps columns [r in/tp, (r+1) in/tp): the input must be
//             the matching slice (the output of a kColwise layer); forward
//             sums the output over tp, the bias added once
//   kVocabParallel  (torch::nn::Embedding) weight [vocab, dim] keeps rows
//             shard_range(vocab, tp, r) (sizes need not divide): each rank
//             looks up the indices in its rows, zeros for the others, the
//             output summed over tp (Megatron's VocabParallelEmbedding). Not
//             with max_norm, scale_grad_by_freq or sparse. An LM head tied to
//             it (the same weight) multiplies by the same rows: its logits hold
//             this rank's vocabulary, for tp::vocab_parallel_cross_entropy
//             (tp/ops.h; the logits are never gathered), and its backward is
//             summed over tp; the vocabulary must then divide by tp.
//
// The values are the dense layer's own, sliced (every rank must hold the same
// dense model: build it after the same seed), so the parallel model starts as
// its dense twin. The parameters stay the same tensors (resized), so an
// optimizer built before or after sees them.
//
// How, without forward hooks: see docs/design/forward-interception.md. The
// sliced weights carry a dispatch key that libtorch 1.13 leaves unused
// (DispatchKey::Fake); one fallback sees every operation on them, after
// autograd, and sums over tp the matrix products that contract over the
// sliced dimension (Megatron's f and g, found where they happen). Any other
// contraction of a sliced weight is an error, never a silent partial sum.
// Embedding lookups need the shift into the rank's rows before autograd
// records them: a kernel for aten::embedding on a second unused key
// (DispatchKey::DeferredInit, above autograd).
// Wrap after moving the model (Module::to() would drop the key).

#include <torch/nn/module.h>

#include <map>
#include <string>

#include "meshtrain/comm/communicator.h"

namespace meshtrain {
namespace tp {

enum class Style { kColwise, kRowwise, kVocabParallel };

// Plan: layer path ("block.fc1", as in named_modules()) -> style. Every path
// must name a torch::nn::Linear whose sliced dimension divides by tp, or (for
// kVocabParallel) a torch::nn::Embedding; all are checked before any changes.
void parallelize(torch::nn::Module& model, const comm::CommPtr& tp, const std::map<std::string, Style>& plan);

}  // namespace tp
}  // namespace meshtrain
