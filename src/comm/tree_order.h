#pragma once
// comm::tree_order(inner): the same communicator, with sums whose bits do not
// depend on the number of ranks' algorithm or backend (issue 33's
// deterministic mode hands it to the data-parallel wrappers).
//
// Note [Tree-order sums]
// A ring or a shared-memory reduction adds the ranks' tensors in an order of
// its own (ring position, arrival, host first), so the same values give other
// last bits on another layout. Here all_reduce, reduce_scatter and reduce with
// kSum or kAvg on floating-point tensors move each rank's shard to its owner
// with one all_to_all ((n-1)/n of the buffer per rank, as a ring's
// reduce-scatter), and the owner adds the n pieces as the balanced binary tree
// over rank index: level 1 adds ranks (0,1), (2,3), ..., level 2 those pairs'
// sums, and so on (Note [Grain tree] in dp/grain_tree.h). All-reduce then
// all-gathers the shards. kAvg divides the tree's sum by n, a power of two:
// exact. The size must be a power of two. Max, min, products and integer
// tensors go to the inner communicator unchanged (their results do not depend
// on the order). Everything else is forwarded, traffic included; split()
// returns the inner communicator's groups, without tree order.
//
// The operations complete before they return (the Work is done): there is no
// overlap with the caller's computation, the mode's price.

#include "meshtrain/comm.h"

namespace meshtrain {
namespace comm {

CommPtr tree_order(CommPtr inner);

// The balanced binary tree's sum of n tensors in rank order (n a power of
// two), as the tree-order communicator forms it (it adds into pieces[0]
// and its left siblings; pass tensors it may overwrite).
at::Tensor sum_in_tree_order(std::vector<at::Tensor> pieces);

}  // namespace comm
}  // namespace meshtrain
