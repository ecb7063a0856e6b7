#pragma once
// Gradient bucket assignment (pure). Parameters are taken in the order their
// gradients are expected to become ready (reverse registration order before the
// first step; the observed order after it) and packed into buckets of one dtype
// each; a bucket closes as soon as it holds at least its cap (PyTorch's rule):
// `first_cap_bytes` for a dtype's first bucket (so the first all-reduce starts
// early in backward), `cap_bytes` for the others. A bucket can therefore pass
// its cap by its last parameter.

#include <cstdint>
#include <vector>

namespace meshtrain {
namespace dp {

struct BucketParam {
  int64_t bytes;
  int dtype;  // any id; buckets never mix ids
};

// Returns buckets as lists of parameter indices, in launch order.
std::vector<std::vector<size_t>> assign_buckets(const std::vector<BucketParam>& params,
                                                const std::vector<size_t>& ready_order,
                                                int64_t first_cap_bytes, int64_t cap_bytes);

}  // namespace dp
}  // namespace meshtrain
