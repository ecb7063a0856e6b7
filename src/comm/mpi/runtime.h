#pragma once
// The MPI library's life in this process, and the pieces every MPI
// communicator shares: initialization (once, with MPI_THREAD_MULTIPLE),
// finalization (once, at exit; see Note [Leaving MPI] in runtime.cpp), the
// dtype and reduction maps, and the polling wait.

#include <ATen/core/Tensor.h>
#include <mpi.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "meshtrain/comm.h"

namespace meshtrain {
namespace comm {
namespace mpi_backend {

// Counts a communicator in, initializing MPI on first use. `timeout` bounds
// MPI_Finalize at exit (the largest one seen is kept). ConfigError when MPI
// was already finalized, or when the library cannot serve several threads at
// once (MPI_THREAD_MULTIPLE): every communicator has a worker thread of its own.
void attach(std::chrono::milliseconds timeout);
// Counts a communicator out (its MPI_Comm is freed or abandoned).
void detach();

// MPI's state is unknown from now on (a collective that can no longer be
// cancelled is pending, MPI returned an error, or an exception unwound past a
// communicator): this process must not call MPI_Finalize, which would wait
// for peers that may never come. `why` is printed at exit.
void note_failure(const std::string& why);
bool failed();
// Keeps `buffers` alive until the process ends: a request that MPI cannot
// cancel may still read or write them.
void abandon(std::vector<at::Tensor> buffers);

// The MPI datatype moving `dtype` (float16 and bfloat16 as 2-byte integers:
// MPI-3 has no such types; reductions on them go through op_for).
MPI_Datatype datatype_of(at::ScalarType dtype);
// The MPI_Op for `op` on `dtype`; kAvg gives the sum (the caller divides).
// See Note [MPI reductions] in runtime.cpp.
MPI_Op op_for(at::ScalarType dtype, ReduceOp op);

// The pause between two polls of MPI: none for the first `spin_us` (MPI
// progresses only inside MPI calls, so a waiter polls back to back), then a
// sleep of an eighth of the time waited so far, between 1 us and 256 us, so
// that ranks sharing cores leave them to the peers that must make progress,
// and a wait overshoots by about 1/8 at most. (A non-blocking collective
// advances only while its ranks poll: a rank asleep delays each of its
// rounds, and a sleep that doubles at each poll made a 4 KiB all_reduce 10x
// slower.) While it sleeps, the thread's timer slack is 1 us instead of
// Linux's 50 us (restored after); sleeps still last 10-50 us on a VM.
class Backoff {
 public:
  explicit Backoff(int spin_us);
  ~Backoff();
  void pause();

 private:
  std::chrono::steady_clock::time_point start_, spin_end_;
  long saved_slack_ns_ = -1;  // the thread's timer slack, once lowered
};

// Polls `requests` with MPI_Testall until all completed (true) or `deadline`
// passed (false). MPI makes progress only inside MPI calls, so the waiter
// keeps calling, with a Backoff between calls. An MPI error code is returned
// in `error` (with true).
bool poll_all(MPI_Request* requests, int count, std::chrono::steady_clock::time_point deadline, int spin_us,
              int& error);

// The largest message OpenMPI's shared-memory transport sends eagerly (one
// copy in, one out, no handshake), as the library reports it through the MPI
// tool interface (MCA variable btl_vader_eager_limit, btl_sm_eager_limit in
// OpenMPI 5, 4096 bytes by default), including the library's own headers;
// 0 when the library does not say (another MPI). Read once per process;
// MpiTuning::eager_bytes (MESHTRAIN_MPI_EAGER_BYTES) overrides it for a
// communicator (0: never split a message in two).
int64_t shared_memory_eager_limit();

// "MPI_ERR_TRUNCATE: message truncated".
std::string error_string(int code);

}  // namespace mpi_backend
}  // namespace comm
}  // namespace meshtrain
