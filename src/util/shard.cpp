#include "util/shard.h"

#include "meshtrain/util.h"

namespace meshtrain {

int64_t shard_size(int64_t numel, int parts, int index) {
  MESHTRAIN_CHECK(parts > 0, "shard_size: parts must be positive, got ", parts);
  MESHTRAIN_CHECK(index >= 0 && index < parts, "shard_size: index ", index,
                  " out of range [0, ", parts, ")");
  MESHTRAIN_CHECK(numel >= 0, "shard_size: numel must be >= 0, got ", numel);
  const int64_t base = numel / parts;
  return base + (index < numel % parts ? 1 : 0);
}

Range shard_range(int64_t numel, int parts, int index) {
  const int64_t size = shard_size(numel, parts, index);
  const int64_t base = numel / parts;
  const int64_t extra = numel % parts;
  // Shards before `index` hold `base` each, plus one for each of the first `extra`.
  const int64_t offset = base * index + (index < extra ? index : extra);
  return Range{offset, size};
}

std::vector<int64_t> shard_sizes(int64_t numel, int parts) {
  std::vector<int64_t> sizes(parts);
  for (int i = 0; i < parts; ++i) sizes[i] = shard_size(numel, parts, i);
  return sizes;
}

std::vector<int64_t> offsets_of(const std::vector<int64_t>& sizes) {
  std::vector<int64_t> offsets(sizes.size(), 0);
  for (size_t i = 1; i < sizes.size(); ++i) offsets[i] = offsets[i - 1] + sizes[i - 1];
  return offsets;
}

}  // namespace meshtrain
