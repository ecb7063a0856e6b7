// MpiCommunicator: construction, the world, split, and waiting. Collectives
// are in collectives.cpp, point-to-point messages in p2p.cpp.

#include "communicator.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <exception>
#include <numeric>

#include "../backend.h"
#include "meshtrain/comm.h"
#include "meshtrain/util.h"
#include "runtime.h"
#include "world.h"

namespace meshtrain {
namespace comm {
namespace mpi_backend {

namespace {

using Clock = std::chrono::steady_clock;

// MpiTuning::spin: how long a waiter polls MPI before it sleeps between polls.
int spin_us(const CommOptions& options) { return static_cast<int>(options.tuning.mpi.spin.count()); }

int rank_in(MPI_Comm comm) {
  int rank = 0;
  MPI_Comm_rank(comm, &rank);
  return rank;
}

// A duplicate of `comm` for the header round (Note [MPI header round] in
// collectives.cpp), or none where the round is an MPI_Iallgather. Made
// without blocking, as the world is, so that a member that never gets here
// (one that failed between MPI_Comm_split and this) is a TimeoutError.
MPI_Comm round_comm_for(MPI_Comm comm, const CommOptions& options, const std::string& where) {
  int n = 0;
  MPI_Comm_size(comm, &n);
  if (n == 1 || n > MpiCommunicator::kDirectRoundMax) return MPI_COMM_NULL;
  MPI_Comm dup = MPI_COMM_NULL;
  MPI_Request request;
  int rc = MPI_Comm_idup(comm, &dup, &request);
  if (rc == MPI_SUCCESS && !poll_all(&request, 1, Clock::now() + options.timeout, spin_us(options), rc)) {
    note_failure(str_cat(where, ": the header round's communicator was never made"));
    throw TimeoutError(str_cat(where, ": not every member made the new communicator within ",
                               options.timeout.count(), " ms"));
  }
  if (rc != MPI_SUCCESS) throw CommError(str_cat(where, ": MPI_Comm_idup failed: ", error_string(rc)));
  MPI_Comm_set_errhandler(dup, MPI_ERRORS_RETURN);
  return dup;
}

bool mpi_finalized() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  return finalized != 0;
}

}  // namespace

// The creator of `comm` has attached (runtime.h) on this communicator's behalf.
MpiCommunicator::MpiCommunicator(MPI_Comm comm, MPI_Comm round_comm, std::vector<int> global_ranks,
                                 CommOptions options)
    : QueuedCommunicator(std::move(global_ranks), rank_in(comm), std::move(options)),
      comm_(comm),
      spin_us_(spin_us(options_)),
      round_comm_(round_comm) {
  // Errors come back as codes (CommError naming the call) instead of aborting the job.
  MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
  headers_ = at::empty({static_cast<int64_t>(size() * sizeof(Header))}, at::kByte);
  const int64_t capacity = message_capacity();
  if (direct_round()) {
    round_send_ = at::empty({size() * capacity}, at::kByte);  // a message per peer
    round_recv_ = at::empty({size() * capacity}, at::kByte);
  }
  // OpenMPI's own headers took 41-72 bytes of the eager limit here (measured: 4,024 bytes went eagerly, 4,056 not).
  constexpr int64_t kTransportHeaders = 128;
  const auto& set = options_.tuning.mpi.eager_bytes;
  const int64_t eager = (set ? *set : shared_memory_eager_limit()) - kTransportHeaders;
  first_message_bytes_ = eager >= static_cast<int64_t>(sizeof(Header)) + 1024 ? std::min(eager, capacity) : capacity;
}

MpiCommunicator::~MpiCommunicator() {
  if (std::uncaught_exceptions() > 0) {
    // This rank is leaving its peers mid-job; they may be waiting in a
    // collective with it. See Note [Leaving MPI].
    note_failure(str_cat("communicator '", options_.label, "' was destroyed by an exception"));
  }
  stop_worker();
  if (!mpi_finalized()) {
    drain_p2p();
    if (abandoned_) {
      // A request that will never complete may still use the communicator and the headers.
      abandon({headers_, round_send_, round_recv_});
    } else {
      MPI_Comm_free(&comm_);
      if (round_comm_ != MPI_COMM_NULL) MPI_Comm_free(&round_comm_);
    }
  }
  detach();
}

// ---- MPI calls and waiting

void MpiCommunicator::check(int code, const char* op, const char* call) {
  if (code == MPI_SUCCESS) return;
  abandoned_ = true;
  const std::string what = str_cat(where(op), ": ", call, " failed: ", error_string(code));
  note_failure(what);
  throw CommError(what);
}

void MpiCommunicator::wait(std::vector<MPI_Request>& requests, const char* op, std::vector<at::Tensor> buffers,
                           const std::string& waiting_for) {
  int error = MPI_SUCCESS;
  if (poll_all(requests.data(), static_cast<int>(requests.size()), Clock::now() + options_.timeout, spin_us_, error)) {
    check(error, op, "MPI_Testall");
    return;
  }
  abandoned_ = true;
  abandon(std::move(buffers));
  note_failure(str_cat(where(op), " timed out"));
  const std::string what =
      str_cat(where(op), ": no progress for ", options_.timeout.count(), " ms while waiting for ", waiting_for,
              "; a rank is stuck, or did not call ", op, " (every rank must call collectives in the same order). "
              "MPI cannot cancel the operation: this communicator is unusable, and this process will leave MPI "
              "without MPI_Finalize (mpirun then ends the job)");
  throw TimeoutError(what);
}

void MpiCommunicator::wait(MPI_Request request, const char* op, std::vector<at::Tensor> buffers) {
  std::vector<MPI_Request> requests = {request};
  wait(requests, op, std::move(buffers), "every rank of the communicator");
}

// ---- split: MPI_Comm_split, after an exchange that shows every member is in it

std::shared_ptr<Communicator> MpiCommunicator::split(int color, int key, const std::string& label) {
  auto child = std::make_shared<MPI_Comm>(MPI_COMM_NULL);
  const at::Tensor mine = at::tensor({static_cast<int64_t>(color), static_cast<int64_t>(key)}, at::kLong);
  auto work = enqueue(OpKind::kAllGather, "split", [this, mine, color, key, child](std::vector<at::Tensor>& result) {
    // The exchange is verified (a rank calling all_gather instead is a
    // MismatchError) and ends only when every member has joined the split, so
    // MPI_Comm_split, which has no non-blocking form and no timeout, finishes at once.
    gather_flat(mine, at::Tensor(), /*splitting=*/true, result);
    if (color >= 0) attach(options_.timeout);  // on the child's behalf
    const int rc = MPI_Comm_split(comm_, color < 0 ? MPI_UNDEFINED : color, key, child.get());
    if (rc != MPI_SUCCESS && color >= 0) detach();
    check(rc, "split", "MPI_Comm_split");
  });
  work->wait();
  auto group = split_group_of(work->result().at(0).view({size(), 2}), *this, color);
  if (!group) return nullptr;
  if (rank_in(*child) != group->rank) {
    MPI_Comm_free(child.get());
    detach();
    throw CommError(str_cat(where("split"), ": MPI_Comm_split ranked this process ", rank_in(*child),
                            " in the new group, but the (key, rank) order gives ", group->rank));
  }
  CommOptions options = options_;
  options.label = label;
  const MPI_Comm round = round_comm_for(*child, options, where("split"));
  return std::make_shared<MpiCommunicator>(*child, round, std::move(group->global_ranks), std::move(options));
}

// ---- the world

CommPtr make_world(CommOptions options) {
  attach(options.timeout);
  MPI_Comm world = MPI_COMM_NULL;
  try {
    // Non-blocking, so that a rank that never reaches this point is a TimeoutError, not a hang.
    MPI_Request request;
    int rc = MPI_Comm_idup(MPI_COMM_WORLD, &world, &request);
    if (rc != MPI_SUCCESS) throw CommError(str_cat("backend mpi: MPI_Comm_idup failed: ", error_string(rc)));
    if (!poll_all(&request, 1, Clock::now() + options.timeout, spin_us(options), rc)) {
      note_failure("the world communicator was never made");
      throw TimeoutError(str_cat("connecting communicator '", options.label, "' (backend mpi): not every rank of "
                                 "the mpirun job reached init_from_env within ", options.timeout.count(), " ms"));
    }
    if (rc != MPI_SUCCESS) throw CommError(str_cat("backend mpi: MPI_Comm_idup failed: ", error_string(rc)));
    int n = 0;
    MPI_Comm_size(world, &n);
    std::vector<int> ranks(n);
    std::iota(ranks.begin(), ranks.end(), 0);
    const MPI_Comm round =
        round_comm_for(world, options, str_cat("connecting communicator '", options.label, "' (backend mpi)"));
    return std::make_shared<MpiCommunicator>(world, round, std::move(ranks), std::move(options));
  } catch (...) {
    detach();
    throw;
  }
}

}  // namespace mpi_backend
}  // namespace comm
}  // namespace meshtrain
