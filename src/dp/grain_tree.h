#pragma once
// The fixed summation tree of deterministic data parallelism (issue 33): a
// sum whose bits do not depend on how many ranks computed it.
//
// Note [Grain tree]
// The global batch is cut into G grains (G a power of two), g_0 .. g_{G-1}.
// Their sum is always formed as the balanced binary tree over grain index:
// node(0, i) = g_i, node(l, i) = node(l-1, 2i) + node(l-1, 2i+1), the root is
// node(log2 G, 0). Every aligned block of 2^k consecutive grains is a
// subtree. So n ranks (n a power of two dividing G), rank r holding grains
// [r G/n, (r+1) G/n), each form their subtree's root, and combining the n
// roots by the same tree (combine_in_tree_order) gives the one-process root
// bit for bit: the same additions of the same operands, only on other ranks.
// Floating-point addition is commutative, so a + b and b + a agree; what the
// tree fixes is the association, which is what layouts change otherwise.
//
// TreeAccumulator forms a subtree's root as grains arrive in index order,
// holding at most log2(grains) + 1 partial sums (a binary counter: the k-th
// partial is the sum of a complete block of 2^k grains), not one per grain.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <utility>
#include <vector>

namespace meshtrain {
namespace dp {

bool is_power_of_two(int64_t x);

// Deterministic training's data: dp rank r's micro-batch j is grain
// j * dp_size + r, so that each micro-batch's reduction over the ranks forms
// one subtree of the grain tree (Note [Deterministic training] in
// src/train/module_trainer.cpp).
inline int64_t grain_index(int64_t microbatch, int dp_rank, int dp_size) { return microbatch * dp_size + dp_rank; }

class TreeAccumulator {
 public:
  // The next grain, in index order (taken over: the accumulator may add into it).
  void add(at::Tensor grain);
  // The root of the grains added so far; their count must be a power of two.
  at::Tensor root() const;
  int64_t count() const { return count_; }
  // Partial sums held now (at most log2(count) + 1).
  size_t partials() const { return stack_.size(); }

 private:
  std::vector<std::pair<int, at::Tensor>> stack_;  // (level, sum of 2^level grains), levels strictly decreasing
  int64_t count_ = 0;
};

// The roots of n consecutive equal subtrees, in index order (n a power of
// two), combined by the tree above them: the sum over all their grains.
at::Tensor combine_in_tree_order(std::vector<at::Tensor> roots);

}  // namespace dp
}  // namespace meshtrain
