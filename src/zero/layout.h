#pragma once
// ZeRO's shard arithmetic (pure). Parameters are laid end to end in one flat
// buffer (in the order given: gradient-ready order for stages 1-2, unit by
// unit for stage 3); the buffer is cut into buckets at parameter boundaries,
// and every bucket is split over the ranks with shard_sizes (uneven sizes are
// fine). Rank r owns shard r of every bucket; its shard buffer is those shards
// end to end. A reduce-scatter of a bucket hands each rank exactly its shard;
// an all-gather of the shards rebuilds the bucket.

#include <cstdint>
#include <vector>

#include "util/shard.h"

namespace meshtrain {
namespace zero {

// Where parameter `param` lies in the flat buffer.
struct FlatEntry {
  size_t param;
  int64_t offset;
  int64_t numel;
};

// A contiguous range of this rank's ownership inside one parameter.
struct ShardPiece {
  size_t param;          // index into the caller's parameter list
  size_t bucket;
  int64_t flat_offset;   // in the flat buffer
  int64_t param_offset;  // within the parameter, flattened
  int64_t shard_offset;  // within this rank's shard buffer
  int64_t numel;
};

struct Bucket {
  int64_t begin = 0, end = 0;  // range of the flat buffer
  std::vector<int64_t> shard_sizes;  // per rank
  int64_t numel() const { return end - begin; }
  Range shard(int rank) const;  // absolute range in the flat buffer
};

struct Layout {
  std::vector<FlatEntry> entries;  // in flat order
  std::vector<Bucket> buckets;
  int64_t total = 0;
  int world = 1;

  // This rank's pieces, in flat order; their numels sum to shard_numel(rank).
  std::vector<ShardPiece> pieces(int rank) const;
  int64_t shard_numel(int rank) const;
  // Offset of bucket b's shard within rank r's shard buffer.
  int64_t shard_offset(int rank, size_t bucket) const;
};

// numels[i]: parameter order[i]'s size, in flat order. A bucket closes before a
// parameter that would take it past cap_numel (a larger parameter gets a bucket
// of its own).
Layout make_layout(const std::vector<size_t>& order, const std::vector<int64_t>& numels_by_param,
                   int64_t cap_numel, int world);

}  // namespace zero
}  // namespace meshtrain
