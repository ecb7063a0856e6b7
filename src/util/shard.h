#pragma once
// Shard arithmetic: how a flat buffer of `numel` elements is split over `parts`
// ranks when numel does not divide evenly. The first numel % parts shards get
// one element more (torch.tensor_split's rule), so shard sizes differ by at most
// one and every rank can compute every other rank's range without communicating.
// Used by reduce_scatter/all_gather (comm) and by ZeRO's partitioning.

#include <cstdint>
#include <vector>

namespace meshtrain {

struct Range {
  int64_t offset = 0;
  int64_t size = 0;
  int64_t end() const { return offset + size; }
  bool operator==(const Range& o) const { return offset == o.offset && size == o.size; }
};

// Size of shard `index` of `numel` elements split into `parts`.
int64_t shard_size(int64_t numel, int parts, int index);
// Offset and size of shard `index`.
Range shard_range(int64_t numel, int parts, int index);
// Sizes of all shards, in rank order; they sum to numel.
std::vector<int64_t> shard_sizes(int64_t numel, int parts);
// Exclusive prefix sums of sizes: offsets[i] = sizes[0] + ... + sizes[i-1].
std::vector<int64_t> offsets_of(const std::vector<int64_t>& sizes);

}  // namespace meshtrain
