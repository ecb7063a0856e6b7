#pragma once
// meshtrain/tp.h: tensor and sequence parallelism: parallelize(module, tp, plan) and Megatron's conjugate operations.
// Part of the public API (meshtrain/meshtrain.h includes it); the sections below
// are in dependency order.

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <map>
#include <string>

#include "meshtrain/comm.h"

// ===== ops =====
// Megatron's conjugate communication operations, as autograd functions over a
// tensor-parallel communicator. Each is one collective in forward and its
// conjugate in backward, so that a chain of column- then row-parallel layers
// costs one all-reduce in forward and one in backward.
//
//   copy_to_tp        identity           | all-reduce (sum)   ("f")
//   reduce_from_tp    all-reduce (sum)   | identity           ("g")
//   scatter_to_tp     split along dim    | all-gather along dim
//   gather_from_tp    all-gather along dim | split along dim
//   Sequence parallel (the sequence is dim 1 of [batch, seq, hidden]):
//   scatter_to_sp     split the sequence | all-gather the sequence
//   gather_from_sp    all-gather the sequence | reduce-scatter the sequence
//   reduce_scatter_to_sp  reduce-scatter the sequence | all-gather the sequence
// With a null communicator or one of size 1 each is the identity.

namespace meshtrain {
namespace tp {

at::Tensor copy_to_tp(const at::Tensor& x, const comm::CommPtr& tp);
at::Tensor reduce_from_tp(const at::Tensor& x, const comm::CommPtr& tp);
at::Tensor scatter_to_tp(const at::Tensor& x, int64_t dim, const comm::CommPtr& tp);
at::Tensor gather_from_tp(const at::Tensor& x, int64_t dim, const comm::CommPtr& tp);
at::Tensor scatter_to_sp(const at::Tensor& x, const comm::CommPtr& tp);
at::Tensor gather_from_sp(const at::Tensor& x, const comm::CommPtr& tp);
at::Tensor reduce_scatter_to_sp(const at::Tensor& x, const comm::CommPtr& tp);

// The plain collectives the operations are made of (no autograd).
at::Tensor all_gather_along(const at::Tensor& x, int64_t dim, comm::Communicator& tp);
at::Tensor reduce_scatter_along(const at::Tensor& x, int64_t dim, comm::Communicator& tp);
at::Tensor split_along(const at::Tensor& x, int64_t dim, const comm::Communicator& tp);

// Cross-entropy over logits whose vocabulary is split by tp (rank r holds
// columns [r*V/tp, (r+1)*V/tp)), without gathering them: the max, the sum of
// exponentials and the target's logit are all-reduced (three small
// all-reduces of batch x seq values); the backward needs no communication.
// logits [N, V/tp], targets [N] (global ids). Returns the mean loss.
at::Tensor vocab_parallel_cross_entropy(const at::Tensor& logits, const at::Tensor& targets, const comm::CommPtr& tp);

// ===== parallelize =====
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
//             (meshtrain/tp.h; the logits are never gathered), and its backward is
//             summed over tp; the vocabulary must then divide by tp.
//
//   kSequenceParallel  only with ParallelizeOptions::sequence_parallel, for
//             what stays replicated inside the sequence-parallel region:
//             a module with replicated parameters (a LayerNorm, an RMSNorm)
//             sees this rank's part of the sequence, so its parameters'
//             gradients are summed over tp as backward computes them; a
//             table read by the whole sequence's indices (a torch::nn::Embedding,
//             or a parameter named by its path: "embed.pos", a learned
//             position table read with at::embedding) gives this rank's part
//             of the rows: its look-ups' output [batch, seq, dim] is split
//             along the sequence, and their gradient all-gathered back
//
// Sequence parallelism (Megatron's, ParallelizeOptions::sequence_parallel):
// between the cut layers the activations hold this rank's part of the
// sequence, dimension 1 of [batch, seq, hidden] (seq/tp positions; the norms,
// residuals and dropout work on 1/tp of them): kColwise layers all-gather the
// sequence of their input, kRowwise layers and kVocabParallel embeddings
// reduce-scatter their output over it (instead of the all-reduce), a kRowwise
// bias gets its gradient summed over tp. Every LayerNorm of the model must be
// planned kSequenceParallel (checked). The code between the layers sees
// seq/tp positions there and the whole sequence inside the cut layers' region
// (attention): read sizes from the tensors there (q's output). A position
// table added after the token embedding is planned kSequenceParallel and read
// with at::embedding (x + at::embedding(table, positions.unsqueeze(0))), or
// sliced by hand (tp::copy_to_tp(table).narrow(0, part * rank, part)); the
// model's input is the whole sequence, the loss's input the head's output,
// whole.
//
// The values are the dense layer's own, sliced (every rank must hold the same
// dense model: build it after the same seed), so the parallel model starts as
// its dense twin. The parameters stay the same tensors (resized), so an
// optimizer built before or after sees them.
//
// How, without forward hooks: see docs/design/forward-interception.md. The cut
// weights carry a dispatch key above autograd that libtorch 1.13 leaves unused
// (DispatchKey::DeferredInit): kernels for aten::linear, matmul, addmm and
// embedding place Megatron's communication (copy_to_tp / all-gather of the
// sequence before a kColwise product, the all-reduce / reduce-scatter after a
// kRowwise one, the shift into a vocabulary's rows) where autograd records
// it, so backward follows; layers that read one input (q, k, v) share one
// communication of it. Below autograd (DispatchKey::Fake) any other
// contraction of a cut weight in a forward that records gradients is an
// error, never a silent partial sum.
// Wrap after moving the model (Module::to() would drop the keys).

enum class Style { kColwise, kRowwise, kVocabParallel, kSequenceParallel };
// A style by its name, for plans kept as data (models::tp_plan, a config
// file): "colwise", "rowwise", "vocab_parallel", "sequence_parallel";
// ConfigError naming the choices otherwise.
Style parse_style(const std::string& name);
std::string style_name(Style style);

struct ParallelizeOptions {
  bool sequence_parallel = false;  // Megatron's sequence parallelism (above)
};

// Plan: layer path ("block.fc1", as in named_modules()) -> style. Every path
// must name a torch::nn::Linear whose sliced dimension divides by tp, (for
// kVocabParallel) a torch::nn::Embedding, or (kSequenceParallel) a module
// without children or a parameter ("embed.pos"); all are checked before any
// changes, and a layer is cut once (planned at two paths, or parallelized
// twice: refused). Under sequence
// parallelism every torch::nn::LayerNorm with trainable parameters must be
// planned kSequenceParallel; plan a norm meshtrain cannot recognise (a user's
// RMSNorm) too, and route any other replicated parameter that meets the
// sequence's part through tp::copy_to_tp, as the position table above.
void parallelize(torch::nn::Module& model, const comm::CommPtr& tp, const std::map<std::string, Style>& plan,
                 ParallelizeOptions options = {});
// The same with the styles by name (parse_style): a plan kept as data.
void parallelize(torch::nn::Module& model, const comm::CommPtr& tp, const std::map<std::string, std::string>& plan,
                 ParallelizeOptions options = {});

// The dimension tp::parallelize cut `param` along (0: a kColwise weight or
// bias, a vocabulary's rows; 1: a kRowwise weight), or -1 (replicated).
int64_t sliced_dim(const at::Tensor& param);

}  // namespace tp
}  // namespace meshtrain
