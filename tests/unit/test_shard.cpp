#include <gtest/gtest.h>

#include "comm/ring.h"
#include "meshtrain/util.h"
#include "util/shard.h"

using namespace meshtrain;

TEST(Shard, SizesDifferByAtMostOneAndSum) {
  for (int64_t numel : {0, 1, 7, 10, 1003}) {
    for (int parts = 1; parts <= 8; ++parts) {
      auto sizes = shard_sizes(numel, parts);
      int64_t sum = 0;
      for (int i = 0; i < parts; ++i) {
        sum += sizes[i];
        EXPECT_LE(sizes[0] - sizes[i], 1);
        EXPECT_EQ(shard_range(numel, parts, i).offset, offsets_of(sizes)[i]);
      }
      EXPECT_EQ(sum, numel);
    }
  }
  EXPECT_EQ(shard_sizes(10, 4), (std::vector<int64_t>{3, 3, 2, 2}));
  EXPECT_EQ(shard_range(10, 4, 2), (Range{6, 2}));
}

TEST(Shard, RejectsBadArguments) {
  EXPECT_THROW(shard_size(10, 0, 0), ConfigError);
  EXPECT_THROW(shard_size(10, 4, 4), ConfigError);
}

// Simulates the ring schedule: after reduce-scatter rank r holds chunk r summed
// over all ranks; after all-gather every rank holds every chunk.
TEST(Ring, ReduceScatterThenAllGatherComputesTheSum) {
  for (int n = 2; n <= 7; ++n) {
    // value[r][c]: the set of ranks whose contribution rank r holds for chunk c (bitmask).
    std::vector<std::vector<unsigned>> value(n, std::vector<unsigned>(n));
    for (int r = 0; r < n; ++r)
      for (int c = 0; c < n; ++c) value[r][c] = 1u << r;
    for (int s = 0; s < n - 1; ++s) {
      auto next = value;
      for (int r = 0; r < n; ++r) {
        const int left = comm::ring_mod(r - 1, n);
        const auto st = comm::reduce_scatter_step(r, n, s);
        EXPECT_EQ(comm::reduce_scatter_step(left, n, s).send_chunk, st.recv_chunk);
        next[r][st.recv_chunk] = value[left][st.recv_chunk] | value[r][st.recv_chunk];
      }
      value = next;
    }
    const unsigned all = (1u << n) - 1;
    for (int r = 0; r < n; ++r) EXPECT_EQ(value[r][r], all) << "n=" << n << " r=" << r;
    for (int s = 0; s < n - 1; ++s) {
      auto next = value;
      for (int r = 0; r < n; ++r) {
        const int left = comm::ring_mod(r - 1, n);
        const auto st = comm::all_gather_step(r, n, s);
        EXPECT_EQ(comm::all_gather_step(left, n, s).send_chunk, st.recv_chunk);
        next[r][st.recv_chunk] = value[left][st.recv_chunk];
      }
      value = next;
    }
    for (int r = 0; r < n; ++r)
      for (int c = 0; c < n; ++c) EXPECT_EQ(value[r][c], all) << "n=" << n;
  }
}
