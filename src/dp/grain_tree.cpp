// The fixed summation tree (Note [Grain tree] in dp/grain_tree.h).
#include "dp/grain_tree.h"

#include <ATen/ATen.h>

#include "meshtrain/util.h"

namespace meshtrain {
namespace dp {

bool is_power_of_two(int64_t x) { return x > 0 && (x & (x - 1)) == 0; }

void TreeAccumulator::add(at::Tensor grain) {
  int level = 0;
  at::Tensor sum = std::move(grain);
  // A binary counter: a complete block of the same size on top merges with the new one, its left sibling.
  while (!stack_.empty() && stack_.back().first == level) {
    sum = stack_.back().second.add_(sum);
    stack_.pop_back();
    ++level;
  }
  stack_.emplace_back(level, std::move(sum));
  ++count_;
}

at::Tensor TreeAccumulator::root() const {
  MESHTRAIN_CHECK(is_power_of_two(count_), "the grain tree needs a power-of-two number of grains; got ", count_);
  return stack_.back().second;  // a power of two of grains: one complete block
}

at::Tensor combine_in_tree_order(std::vector<at::Tensor> roots) {
  MESHTRAIN_CHECK(is_power_of_two(static_cast<int64_t>(roots.size())),
                  "combine_in_tree_order needs a power-of-two number of subtrees; got ", roots.size());
  TreeAccumulator above;
  for (auto& r : roots) above.add(r.clone());  // the subtrees are the leaves of the tree above them
  return above.root();
}

}  // namespace dp
}  // namespace meshtrain
