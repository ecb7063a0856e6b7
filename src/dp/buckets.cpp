#include "dp/buckets.h"

#include <map>

#include "meshtrain/util.h"

namespace meshtrain {
namespace dp {

std::vector<std::vector<size_t>> assign_buckets(const std::vector<BucketParam>& params,
                                                const std::vector<size_t>& ready_order,
                                                int64_t first_cap_bytes, int64_t cap_bytes) {
  MESHTRAIN_CHECK(ready_order.size() == params.size(), "assign_buckets: order has ", ready_order.size(),
                  " entries for ", params.size(), " parameters");
  MESHTRAIN_CHECK(cap_bytes > 0 && first_cap_bytes > 0, "bucket caps must be positive");
  std::vector<std::vector<size_t>> buckets;
  // As PyTorch's compute_bucket_assignment_by_size: one open bucket per dtype;
  // a parameter joins its dtype's open bucket, which closes once it holds at
  // least its cap (the first of each dtype: first_cap_bytes). So the first
  // bucket takes the last layer's weight even when it is larger than the first
  // cap, and its all-reduce overlaps the rest of backward.
  std::map<int, size_t> open;        // dtype -> index into buckets
  std::map<int, int> closed;         // dtype -> buckets closed so far
  std::map<size_t, int64_t> filled;  // bucket -> bytes
  for (size_t idx : ready_order) {
    const BucketParam& p = params.at(idx);
    auto it = open.find(p.dtype);
    if (it == open.end()) {
      buckets.emplace_back();
      it = open.emplace(p.dtype, buckets.size() - 1).first;
    }
    const size_t b = it->second;
    buckets[b].push_back(idx);
    filled[b] += p.bytes;
    const int64_t cap = closed[p.dtype] == 0 ? first_cap_bytes : cap_bytes;
    if (filled[b] >= cap) {
      open.erase(it);
      ++closed[p.dtype];
    }
  }
  return buckets;
}

}  // namespace dp
}  // namespace meshtrain
