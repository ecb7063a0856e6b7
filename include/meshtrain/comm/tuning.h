#pragma once
// CommTuning: every tunable of the communication backends, typed, with its
// default, in one struct (gloo's way: an options object per algorithm, not
// globals). CommTuning::from_env() (src/comm/tuning.cpp) is the one place that
// reads them from the environment (the MESHTRAIN_* variable beside each field;
// docs/comm.md, "Tuning", lists them); CommOptions carries the result, so a
// program may also set them in code, and sub-communicators inherit their
// parent's. An unset optional means "chosen for this host" (measured, or derived
// from the host's figures: Note [Self-tuned waits] in host_profile.h).
//
// None of these changes a result: every setting gives the same bits (the
// tests run the algorithms each one selects); they move time only.

#include <chrono>
#include <cstdint>
#include <optional>

namespace meshtrain {
namespace comm {

// The shared-memory backend (src/comm/shm). The sizes are the segment's
// layout: the rank that creates a communicator's segment decides them and
// every member adopts its values.
struct ShmTuning {
  int64_t buffer_bytes = 256 << 10;  // MESHTRAIN_SHM_BUFFER_KB: each of a rank's four collective buffers
  int64_t channel_bytes = 1 << 20;   // MESHTRAIN_SHM_CHANNEL_KB: each point-to-point ring
  // MESHTRAIN_SHM_SMALL_KB: collectives up to this size go in one step; unset:
  // measured (Note [Measured one-step threshold] in shm/one_step.h); 0: never.
  std::optional<int64_t> one_step_bytes;
  // MESHTRAIN_SHM_SPIN_US, MESHTRAIN_SHM_YIELD_US: how long a waiter spins,
  // then yields its core, before it sleeps; unset: from the host's wake-up.
  std::optional<std::chrono::microseconds> spin, yield;
};

// The TCP backend (src/comm/tcp: meshtrain's own links and algorithms; the
// user-facing name is still "gloo", as are its variables).
struct TcpTuning {
  // MESHTRAIN_TCP_SPIN_US, MESHTRAIN_TCP_YIELD_US: a link waiter's budgets;
  // unset: from the host (Note [Link waits on shared cores]). A yield set here
  // applies to messages of every size.
  std::optional<std::chrono::microseconds> spin, yield;
  // MESHTRAIN_TCP_BUFFER_KB: bytes in flight per link to a rank of this host;
  // unset: the L2 over the peers (Note [Link buffers sized to the cache]); 0: the kernel's autotuning.
  std::optional<int64_t> buffer_bytes;
  // MESHTRAIN_GLOO_RING_KB: collectives of at least this size go round the
  // ring instead of the direct exchanges; default never (Note [Gloo algorithms]).
  int64_t ring_bytes = int64_t{1} << 62;
  int64_t chain_bytes = 1 << 20;  // MESHTRAIN_GLOO_CHAIN_KB: broadcasts from here go down a chain (3+ ranks)
  int64_t piece_bytes = 1 << 20;  // MESHTRAIN_GLOO_PIECE_KB: the pipelined all-reduce's pieces
  // MESHTRAIN_GLOO_ROUND=doubling|direct: the header round by recursive
  // doubling on 4..64 ranks (a power of two), or to every peer at once.
  bool doubling_round = true;
};

// The hierarchical backend (src/comm/hier).
struct HierTuning {
  int64_t min_bytes = 64 << 10;  // MESHTRAIN_HIER_MIN_KB: nested collectives from this size, flat below
};

// The MPI backend (src/comm/mpi).
struct MpiTuning {
  // MESHTRAIN_MPI_SPIN_US: a waiter polls MPI back to back this long before it
  // sleeps between polls (Backoff in mpi/runtime.h). Measured on 2 cores (4 KiB
  // all_reduce, verified): 2 ranks ~15 us with 200 us, ~250 us without
  // spinning; 4 ranks ~100-150 us with, ~600-850 us without (yielding the core
  // while polling was slower in both cases).
  std::chrono::microseconds spin{200};
  // MESHTRAIN_MPI_EAGER_BYTES: the largest message OpenMPI sends eagerly, its
  // headers included; unset: what OpenMPI reports; 0: never split a message
  // in two (Note [MPI header round]).
  std::optional<int64_t> eager_bytes;
};

struct CommTuning {
  ShmTuning shm;
  TcpTuning tcp;
  HierTuning hier;
  MpiTuning mpi;

  // The defaults above, with every MESHTRAIN_* variable that is set applied.
  // ConfigError naming the variable, its value and the accepted range otherwise.
  static CommTuning from_env();
};

}  // namespace comm
}  // namespace meshtrain
