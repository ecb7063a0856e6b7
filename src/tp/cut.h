#pragma once
// How tp::parallelize's cut layers compute (internal): the roles a cut
// parameter carries and the kernels that place Megatron's communication
// around the operations that use it. See meshtrain/tp.h for the user's view
// and docs/design/forward-interception.md for the mechanism.
//
// The communication goes where Megatron puts it, in autograd's view of the
// forward, so backward follows by itself: kernels for aten::linear, matmul,
// addmm and embedding on DispatchKey::DeferredInit, a key above autograd that
// libtorch 1.13 leaves unused (every other operation falls through it), which
// the cut weights carry.
//
//   kColwise   x W^T + b    the input through copy_to_tp (under sequence
//                           parallelism: the sequence all-gathered); layers
//                           reading one input (q, k, v) share that one step
//   kRowwise   x W^T + b    the partial product all-reduced (under sequence
//                           parallelism: reduce-scattered over the sequence),
//                           the bias added once
//   embedding               this rank's rows looked up, zeros elsewhere,
//                           summed (reduce-scattered over the sequence); a
//                           SequenceRows table's look-up split over the sequence
//
// Below autograd (DispatchKey::Fake, util/intercept.h) a guard refuses any
// other contraction of a cut weight in a forward that records gradients (a
// partial sum would be silently wrong).

#include <ATen/core/Tensor.h>

#include "meshtrain/comm.h"
#include "meshtrain/tp.h"
#include "util/shard.h"
#include "util/intercept.h"

namespace meshtrain {
namespace tp {

// A weight cut along `dim` (0: rows, kColwise and a vocabulary's; 1: columns,
// kRowwise), recognised in a product by the stride and size of that dimension
// (which tell W from W^T).
class Cut : public intercept::Role {
 public:
  Cut(comm::CommPtr tp, Style style, bool sequence_parallel, const at::Tensor& weight);
  bool run(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) override;

  comm::CommPtr tp;
  Style style;  // kColwise or kRowwise (a vocabulary's rows multiply as kColwise)
  bool sequence_parallel;
  int64_t dim, stride, size;
};

// A cut Linear's bias (kColwise: this rank's outputs' entries), for sliced_dim.
class CutBias : public intercept::Role {};

// This rank's rows of a vocabulary-parallel embedding.
class VocabRows : public intercept::Role {
 public:
  VocabRows(comm::CommPtr tp, Range rows, int64_t padding_idx, bool sequence_parallel)
      : tp(std::move(tp)), rows(rows), padding_idx(padding_idx), sequence_parallel(sequence_parallel) {}
  comm::CommPtr tp;
  Range rows;
  int64_t padding_idx;  // global; -1: none
  bool sequence_parallel;
};

// A replicated table read by the whole sequence's indices under sequence
// parallelism (kSequenceParallel on an Embedding or a parameter): a look-up
// returns this rank's part of the sequence (its output split along dimension
// 1, the gradient all-gathered back), so the rows it adds meet the part of
// the sequence the rank holds.
class SequenceRows : public intercept::Role {
 public:
  explicit SequenceRows(comm::CommPtr tp) : tp(std::move(tp)) {}
  comm::CommPtr tp;
};

const Cut* cut_of(const at::Tensor& t);
const VocabRows* vocab_rows_of(const at::Tensor& t);
const SequenceRows* sequence_rows_of(const at::Tensor& t);
// Marks `table` SequenceRows and routes its look-ups through the kernels.
void mark_sequence_rows(const at::Tensor& table, const comm::CommPtr& tp);

// Routes the products and lookups of `weight` through the kernels above
// (after any set_data; intercept::set_data_keeping_marks keeps the key).
void add_kernel_key(const at::Tensor& weight);

// The gradient of `param` summed over tp as backward computes it (a
// replicated parameter that sees only this rank's part of the sequence);
// summed_over_tp tells whether it already is.
void sum_gradient_over_tp(at::Tensor& param, const comm::CommPtr& tp);
bool summed_over_tp(const at::Tensor& param);

}  // namespace tp
}  // namespace meshtrain
