#include "zero/layout.h"

#include <algorithm>

#include "meshtrain/util.h"

namespace meshtrain {
namespace zero {

Range Bucket::shard(int rank) const {
  const auto offsets = offsets_of(shard_sizes);
  return Range{begin + offsets.at(rank), shard_sizes.at(rank)};
}

Layout make_layout(const std::vector<size_t>& order, const std::vector<int64_t>& numels, int64_t cap_numel, int world) {
  MESHTRAIN_CHECK(world >= 1, "ZeRO layout: world size ", world, " must be positive");
  MESHTRAIN_CHECK(cap_numel >= 1, "ZeRO layout: bucket cap must be positive");
  MESHTRAIN_CHECK(order.size() == numels.size(), "ZeRO layout: order has ", order.size(), " entries for ",
                  numels.size(), " parameters");
  Layout l;
  l.world = world;
  int64_t offset = 0, bucket_begin = 0;
  auto close = [&](int64_t at) {
    if (at == bucket_begin) return;
    Bucket b;
    b.begin = bucket_begin;
    b.end = at;
    b.shard_sizes = shard_sizes(at - bucket_begin, world);
    l.buckets.push_back(b);
    bucket_begin = at;
  };
  for (size_t k = 0; k < order.size(); ++k) {
    const int64_t n = numels.at(order[k]);
    if (offset > bucket_begin && offset - bucket_begin + n > cap_numel) close(offset);
    l.entries.push_back({order[k], offset, n});
    offset += n;
  }
  close(offset);
  l.total = offset;
  return l;
}

int64_t Layout::shard_numel(int rank) const {
  int64_t n = 0;
  for (const auto& b : buckets) n += b.shard_sizes.at(rank);
  return n;
}

int64_t Layout::shard_offset(int rank, size_t bucket) const {
  int64_t n = 0;
  for (size_t b = 0; b < bucket; ++b) n += buckets[b].shard_sizes.at(rank);
  return n;
}

std::vector<ShardPiece> Layout::pieces(int rank) const {
  std::vector<ShardPiece> out;
  size_t e = 0;
  int64_t shard_pos = 0;
  for (size_t b = 0; b < buckets.size(); ++b) {
    const Range own = buckets[b].shard(rank);
    // Entries overlapping [own.offset, own.end()).
    while (e < entries.size() && entries[e].offset + entries[e].numel <= own.offset) ++e;
    for (size_t k = e; k < entries.size() && entries[k].offset < own.end(); ++k) {
      const int64_t lo = std::max(own.offset, entries[k].offset);
      const int64_t hi = std::min(own.end(), entries[k].offset + entries[k].numel);
      if (hi <= lo) continue;
      out.push_back({entries[k].param, b, lo, lo - entries[k].offset, shard_pos + (lo - own.offset), hi - lo});
    }
    shard_pos += own.size;
  }
  return out;
}

}  // namespace zero
}  // namespace meshtrain
