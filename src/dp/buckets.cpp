#include "meshtrain/dp/buckets.h"

#include <map>

#include "meshtrain/util/error.h"

namespace meshtrain {
namespace dp {

std::vector<std::vector<size_t>> assign_buckets(const std::vector<BucketParam>& params,
                                                const std::vector<size_t>& ready_order,
                                                int64_t first_cap_bytes, int64_t cap_bytes) {
  MESHTRAIN_CHECK(ready_order.size() == params.size(), "assign_buckets: order has ", ready_order.size(),
                  " entries for ", params.size(), " parameters");
  MESHTRAIN_CHECK(cap_bytes > 0 && first_cap_bytes > 0, "bucket caps must be positive");
  std::vector<std::vector<size_t>> buckets;
  // One open bucket per dtype; a bucket closes when adding would pass its cap.
  std::map<int, size_t> open;           // dtype -> index into buckets
  std::map<size_t, int64_t> filled;     // bucket -> bytes
  for (size_t idx : ready_order) {
    const BucketParam& p = params.at(idx);
    auto it = open.find(p.dtype);
    if (it != open.end()) {
      const size_t b = it->second;
      const int64_t cap = b == 0 ? first_cap_bytes : cap_bytes;
      if (filled[b] + p.bytes <= cap) {
        buckets[b].push_back(idx);
        filled[b] += p.bytes;
        continue;
      }
    }
    buckets.push_back({idx});
    open[p.dtype] = buckets.size() - 1;
    filled[buckets.size() - 1] = p.bytes;
  }
  return buckets;
}

}  // namespace dp
}  // namespace meshtrain
