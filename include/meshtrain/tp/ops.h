#pragma once
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

#include <ATen/core/Tensor.h>

#include "meshtrain/comm/communicator.h"

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

}  // namespace tp
}  // namespace meshtrain
