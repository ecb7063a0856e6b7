#pragma once
// The layout of one shared-memory communicator's segment, as plain data and
// offset arithmetic (unit-tested without a segment). Every structure that more
// than one process writes starts on its own cache line.
//
//   SegmentHeader
//   RankCtrl[n]                      one per rank: step counter, futex word, op headers
//   buffers[n][4] of buffer_bytes    collective data: [op parity][chunk parity]
//   ChannelCtrl[n][n]                point-to-point rings, one per (src, dst)
//   channel data[n][n] of channel_bytes
//
// The segment lives on tmpfs: pages are allocated when first written, so the
// rings of pairs that never talk, and buffer space a small job never reaches,
// cost no memory.

#include <atomic>
#include <cstddef>
#include <cstdint>

#include "../header.h"

namespace meshtrain {
namespace comm {
namespace shm_backend {

constexpr uint64_t kSegmentMagic = 0x6d65736873686d31ull;  // "meshshm1"
constexpr size_t kLine = 64;

struct SegmentHeader {
  uint64_t magic = 0;
  int32_t ranks = 0;
  int32_t measure_one_step = 0;  // the members measure the one-step threshold (small_bytes unset)
  uint64_t buffer_bytes = 0;   // one collective buffer
  uint64_t channel_bytes = 0;  // one point-to-point ring
  uint64_t small_bytes = 0;    // collectives up to this size travel in one step
  uint64_t total_bytes = 0;
};

// One rank's control block. `step` counts the collective steps this rank has
// posted (see Note [Shared-memory steps] in collectives.cpp); other ranks read
// it. `wake` is the futex word this rank's threads sleep on; a rank that makes
// progress another rank may wait for bumps it when `sleepers` is non-zero.
struct alignas(kLine) RankCtrl {
  std::atomic<uint64_t> step;
  uint8_t pad0[kLine - sizeof(uint64_t)];
  std::atomic<uint32_t> wake;
  std::atomic<uint32_t> sleepers;
  uint8_t pad1[kLine - 2 * sizeof(uint32_t)];
  std::atomic<int32_t> pid;  // non-zero once the rank has mapped the segment
  uint8_t pad2[kLine - sizeof(int32_t)];
  // The arguments of the running collective, by op parity, with its sequence
  // number and the largest payload this rank sends any one peer.
  Header header[2];
  uint64_t header_seq[2];
  uint64_t extent[2];
};

// A point-to-point ring from one rank to another: byte counters, monotonic.
struct alignas(kLine) ChannelCtrl {
  std::atomic<uint64_t> head;  // bytes written by the sender
  uint8_t pad0[kLine - sizeof(uint64_t)];
  std::atomic<uint64_t> tail;  // bytes consumed by the receiver
  uint8_t pad1[kLine - sizeof(uint64_t)];
};

constexpr size_t round_up(size_t x, size_t to) { return (x + to - 1) / to * to; }

struct SegmentLayout {
  int ranks = 1;
  size_t buffer_bytes = 0;
  size_t channel_bytes = 0;

  static constexpr int kBuffersPerRank = 4;  // [op parity][chunk parity]

  size_t ctrl_offset(int r) const { return round_up(sizeof(SegmentHeader), kLine) + r * sizeof(RankCtrl); }
  size_t buffers_begin() const { return round_up(ctrl_offset(ranks), 4096); }
  size_t buffer_offset(int r, int which) const {
    return buffers_begin() + (static_cast<size_t>(r) * kBuffersPerRank + which) * buffer_bytes;
  }
  size_t channel_ctrl_offset(int src, int dst) const {
    return buffer_offset(ranks, 0) + (static_cast<size_t>(src) * ranks + dst) * sizeof(ChannelCtrl);
  }
  size_t channels_begin() const { return round_up(channel_ctrl_offset(ranks, 0), 4096); }
  size_t channel_data_offset(int src, int dst) const {
    return channels_begin() + (static_cast<size_t>(src) * ranks + dst) * channel_bytes;
  }
  size_t total_bytes() const { return channel_data_offset(ranks, 0); }
  // A collective buffer split into one region per rank (cache-line aligned).
  size_t region_bytes() const { return buffer_bytes / ranks / kLine * kLine; }
};

}  // namespace shm_backend
}  // namespace comm
}  // namespace meshtrain
