#pragma once
// The ring schedule shared by reduce-scatter, all-gather and all-reduce, as pure
// functions (unit-tested without communication). Ranks form a ring r -> r+1;
// each of the n-1 steps moves one chunk to the right neighbour.
//
// Reduce-scatter: at step s rank r sends chunk (r-s-1) and receives chunk
// (r-s-2), adding its own contribution; after n-1 steps rank r holds chunk r
// summed over all ranks. All-gather: at step s rank r sends chunk (r-s) and
// receives chunk (r-s-1); after n-1 steps every rank holds every chunk.
// Each rank sends (n-1)/n of the buffer per phase: the bandwidth-optimal volume.

namespace meshtrain {
namespace comm {

struct RingStep {
  int send_chunk;
  int recv_chunk;
};

inline int ring_mod(int x, int n) { return ((x % n) + n) % n; }

inline RingStep reduce_scatter_step(int rank, int n, int step) {
  return {ring_mod(rank - step - 1, n), ring_mod(rank - step - 2, n)};
}

inline RingStep all_gather_step(int rank, int n, int step) {
  return {ring_mod(rank - step, n), ring_mod(rank - step - 1, n)};
}

}  // namespace comm
}  // namespace meshtrain
