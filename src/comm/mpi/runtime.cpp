// The MPI library's life in this process; the dtype and reduction maps; the
// polling wait.
//
// Note [Leaving MPI]
// MPI can be initialized once per process, and OpenMPI's MPI_Finalize is a
// fence across the whole job: it returns only once every rank has called it.
// So meshtrain initializes MPI when the first MPI communicator is made and
// finalizes it once, when the process ends normally: from an atexit handler
// registered right after MPI_Init_thread (it runs after the destructors of
// statics constructed later, such as a static world communicator), or earlier
// through comm::finalize_mpi() (processes that end with _exit). A process
// whose MPI state is unknown (a collective timed out and cannot be cancelled,
// MPI returned an error, or an exception unwound past a live communicator: the
// rank is walking away from peers that may be waiting for it) skips
// MPI_Finalize, which could wait forever; it exits without, and mpirun, seeing
// a rank leave without finalizing, ends the job. MPI_Finalize itself is
// bounded too: if it has not returned within the largest communicator timeout
// (a peer never reaches it), a watchdog ends the process with exit code 1.
// A library user who initialized MPI before meshtrain finalizes it too.
//
// Note [MPI reductions]
// MPI's built-in operations serve sum and product of every dtype MPI has, and
// max and min of integers. The rest run meshtrain's own kernel, reduce_into
// (the one every backend uses), as commutative MPI user operations
// (MPI_Op_create): every reduction of bfloat16 and float16, which MPI-3 does
// not know (moved as 2-byte integers), and max and min of floating types,
// where MPI's C comparison keeps or drops a NaN depending on operand order
// while torch (and reduce_into) propagate it. We reduce 16-bit types in their
// own type rather than through float32: a float32 detour would double the
// bytes on the wire (the reason to communicate in 16 bits) and add two
// conversion passes and a buffer per call. The cost: MPI combines pairwise,
// and each combination rounds to the 16-bit type once (up to n - 1 roundings
// for n ranks, as in Gloo's ring), where the shared-memory backend sums all n
// contributions in float32 and rounds once. Sums of small integers, as in the
// tests' closed forms, are exact either way.

#include "runtime.h"

#include <sys/prctl.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <thread>

#include "../reduce.h"
#include "meshtrain/comm.h"
#include "meshtrain/util.h"

namespace meshtrain {
namespace comm {
namespace mpi_backend {

namespace {

template <at::ScalarType kDtype, ReduceOp kOp>
void user_op(void* in, void* inout, int* len, MPI_Datatype*) {
  reduce_into(inout, in, inout, *len, kDtype, kOp);
}

struct UserOp {
  at::ScalarType dtype;
  ReduceOp op;
  MPI_User_function* fn;
};

const UserOp kUserOps[] = {
    {at::kBFloat16, ReduceOp::kSum, &user_op<at::kBFloat16, ReduceOp::kSum>},
    {at::kBFloat16, ReduceOp::kProduct, &user_op<at::kBFloat16, ReduceOp::kProduct>},
    {at::kBFloat16, ReduceOp::kMax, &user_op<at::kBFloat16, ReduceOp::kMax>},
    {at::kBFloat16, ReduceOp::kMin, &user_op<at::kBFloat16, ReduceOp::kMin>},
    {at::kHalf, ReduceOp::kSum, &user_op<at::kHalf, ReduceOp::kSum>},
    {at::kHalf, ReduceOp::kProduct, &user_op<at::kHalf, ReduceOp::kProduct>},
    {at::kHalf, ReduceOp::kMax, &user_op<at::kHalf, ReduceOp::kMax>},
    {at::kHalf, ReduceOp::kMin, &user_op<at::kHalf, ReduceOp::kMin>},
    {at::kFloat, ReduceOp::kMax, &user_op<at::kFloat, ReduceOp::kMax>},
    {at::kFloat, ReduceOp::kMin, &user_op<at::kFloat, ReduceOp::kMin>},
    {at::kDouble, ReduceOp::kMax, &user_op<at::kDouble, ReduceOp::kMax>},
    {at::kDouble, ReduceOp::kMin, &user_op<at::kDouble, ReduceOp::kMin>},
};

// Never destroyed: communicators held by statics may outlive any static here.
struct State {
  std::mutex mutex;
  bool usable = false;         // MPI initialized with MPI_THREAD_MULTIPLE, by us or the user
  bool we_initialized = false;
  int live = 0;                // communicators attached
  std::chrono::milliseconds finalize_timeout{0};
  std::string failure;
  std::vector<at::Tensor> abandoned;
  std::map<std::pair<at::ScalarType, ReduceOp>, MPI_Op> user_ops;
};

State& state() {
  static State* s = new State;
  return *s;
}

const char* thread_level_name(int level) {
  switch (level) {
    case MPI_THREAD_SINGLE: return "MPI_THREAD_SINGLE";
    case MPI_THREAD_FUNNELED: return "MPI_THREAD_FUNNELED";
    case MPI_THREAD_SERIALIZED: return "MPI_THREAD_SERIALIZED";
    case MPI_THREAD_MULTIPLE: return "MPI_THREAD_MULTIPLE";
  }
  return "an unknown thread level";
}

bool is_finalized() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  return finalized != 0;
}

// See Note [Leaving MPI]. Returns true when MPI is finalized on return.
bool finalize(bool at_exit) {
  State& s = state();
  std::unique_lock<std::mutex> lock(s.mutex);
  if (is_finalized()) return true;
  if (!s.we_initialized) return false;
  if (!s.failure.empty()) {
    std::fprintf(stderr, "meshtrain: leaving MPI without MPI_Finalize after an error (%s); mpirun ends the job\n",
                 s.failure.c_str());
    std::fflush(stderr);
    return false;
  }
  if (!at_exit) {
    MESHTRAIN_CHECK(s.live == 0, "finalize_mpi: ", s.live, " MPI communicator(s) still exist; destroy every "
                    "communicator (and the objects holding one) before finalizing MPI");
  }
  const auto timeout = s.finalize_timeout;
  lock.unlock();
  std::mutex m;
  std::condition_variable cv;
  bool done = false;
  std::thread watchdog([&] {
    std::unique_lock<std::mutex> l(m);
    if (!cv.wait_for(l, timeout, [&] { return done; })) {
      std::fprintf(stderr, "meshtrain: MPI_Finalize did not return within %lld ms: a rank of the job never "
                   "reached it; exiting\n", static_cast<long long>(timeout.count()));
      std::fflush(stderr);
      _exit(1);
    }
  });
  MPI_Finalize();
  {
    std::lock_guard<std::mutex> l(m);
    done = true;
  }
  cv.notify_all();
  watchdog.join();
  return true;
}

void finalize_at_exit() { finalize(/*at_exit=*/true); }

}  // namespace

void attach(std::chrono::milliseconds timeout) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  MESHTRAIN_CHECK(!is_finalized(), "backend mpi: MPI was already finalized in this process (finalize_mpi() or exit), "
                  "and MPI can be initialized only once per process; make every MPI communicator before that");
  if (!s.usable) {
    int initialized = 0, provided = MPI_THREAD_SINGLE;
    MPI_Initialized(&initialized);
    if (initialized) {
      MPI_Query_thread(&provided);
    } else {
      const int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
      if (rc != MPI_SUCCESS) throw CommError(str_cat("backend mpi: MPI_Init_thread failed: ", error_string(rc)));
      s.we_initialized = true;
      std::atexit(finalize_at_exit);
    }
    MESHTRAIN_CHECK(provided >= MPI_THREAD_MULTIPLE, "backend mpi needs MPI_THREAD_MULTIPLE (every communicator has "
                    "a worker thread of its own), but this MPI library provides only ", thread_level_name(provided),
                    "; use an MPI built with thread support (OpenMPI >= 3 is by default), or use backend shm or gloo");
    for (const UserOp& u : kUserOps) {
      MPI_Op op = MPI_OP_NULL;
      const int rc = MPI_Op_create(u.fn, /*commute=*/1, &op);
      if (rc != MPI_SUCCESS) throw CommError(str_cat("backend mpi: MPI_Op_create failed: ", error_string(rc)));
      s.user_ops[{u.dtype, u.op}] = op;
    }
    s.usable = true;
  }
  ++s.live;
  s.finalize_timeout = std::max(s.finalize_timeout, timeout);
}

void detach() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  --s.live;
}

void note_failure(const std::string& why) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  if (s.failure.empty()) s.failure = why;
}

bool failed() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  return !s.failure.empty();
}

void abandon(std::vector<at::Tensor> buffers) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  for (auto& b : buffers) {
    if (b.defined()) s.abandoned.push_back(std::move(b));
  }
}

MPI_Datatype datatype_of(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat: return MPI_FLOAT;
    case at::kDouble: return MPI_DOUBLE;
    case at::kInt: return MPI_INT32_T;
    case at::kLong: return MPI_INT64_T;
    case at::kChar: return MPI_INT8_T;
    case at::kByte: return MPI_UINT8_T;
    case at::kBFloat16:
    case at::kHalf: return MPI_UINT16_T;
    default: break;
  }
  throw ConfigError(str_cat("backend mpi: dtype ", dtype, " is not supported"));
}

MPI_Op op_for(at::ScalarType dtype, ReduceOp op) {
  State& s = state();
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    auto it = s.user_ops.find({dtype, op == ReduceOp::kAvg ? ReduceOp::kSum : op});
    if (it != s.user_ops.end()) return it->second;
  }
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg: return MPI_SUM;
    case ReduceOp::kProduct: return MPI_PROD;
    case ReduceOp::kMax: return MPI_MAX;
    case ReduceOp::kMin: return MPI_MIN;
  }
  return MPI_SUM;
}

Backoff::Backoff(int spin_us)
    : start_(std::chrono::steady_clock::now()), spin_end_(start_ + std::chrono::microseconds(spin_us)) {}

Backoff::~Backoff() {
  if (saved_slack_ns_ > 0) prctl(PR_SET_TIMERSLACK, saved_slack_ns_);
}

void Backoff::pause() {
  const auto now = std::chrono::steady_clock::now();
  if (now < spin_end_) return;
  if (saved_slack_ns_ < 0) {
    saved_slack_ns_ = prctl(PR_GET_TIMERSLACK);
    prctl(PR_SET_TIMERSLACK, 1000L);
  }
  const long waited_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(now - start_).count();
  const timespec pause{0, std::clamp(waited_ns / 8, 1000L, 256000L)};
  nanosleep(&pause, nullptr);
}

bool poll_all(MPI_Request* requests, int count, std::chrono::steady_clock::time_point deadline, int spin_us,
              int& error) {
  std::vector<MPI_Status> statuses(count);
  Backoff backoff(spin_us);
  while (true) {
    int flag = 0;
    error = MPI_Testall(count, requests, &flag, statuses.data());
    if (error == MPI_ERR_IN_STATUS) {
      for (const auto& st : statuses) {
        if (st.MPI_ERROR != MPI_SUCCESS && st.MPI_ERROR != MPI_ERR_PENDING) error = st.MPI_ERROR;
      }
    }
    if (error != MPI_SUCCESS || flag != 0) return true;
    if (std::chrono::steady_clock::now() >= deadline) return false;
    backoff.pause();
  }
}

namespace {

// One control variable of the MPI tool interface as an integer, or 0.
int64_t read_cvar(int index, MPI_Datatype type) {
  MPI_T_cvar_handle handle;
  int count = 0;
  if (MPI_T_cvar_handle_alloc(index, nullptr, &handle, &count) != MPI_SUCCESS) return 0;
  int64_t value = 0;
  int size = 0;
  const bool integer = type != MPI_FLOAT && type != MPI_DOUBLE && type != MPI_CHAR;
  if (count == 1 && integer && MPI_Type_size(type, &size) == MPI_SUCCESS) {
    if (size == 4) {
      uint32_t v = 0;
      if (MPI_T_cvar_read(handle, &v) == MPI_SUCCESS) value = v;
    } else if (size == 8) {
      uint64_t v = 0;
      if (MPI_T_cvar_read(handle, &v) == MPI_SUCCESS && v < (uint64_t{1} << 40)) value = static_cast<int64_t>(v);
    }
  }
  MPI_T_cvar_handle_free(&handle);
  return value;
}

// Called after MPI_Init_thread. OpenMPI 4.1's MPI_T_init_thread records the
// thread level it is given as MPI's own: it must be the level MPI was started
// with (attach() requires MPI_THREAD_MULTIPLE).
int64_t read_eager_limit() {
  int provided = 0, n = 0;
  if (MPI_T_init_thread(MPI_THREAD_MULTIPLE, &provided) != MPI_SUCCESS) return 0;
  int64_t limit = 0;
  if (MPI_T_cvar_get_num(&n) == MPI_SUCCESS) {
    for (int i = 0; i < n && limit == 0; ++i) {
      char name[256];
      int name_len = sizeof name, desc_len = 0, verbosity = 0, binding = 0, scope = 0;
      MPI_Datatype type;
      MPI_T_enum enumtype;
      if (MPI_T_cvar_get_info(i, name, &name_len, &verbosity, &type, &enumtype, nullptr, &desc_len, &binding, &scope) !=
          MPI_SUCCESS) {
        continue;
      }
      const std::string var(name);
      if (binding == MPI_T_BIND_NO_OBJECT && (var == "btl_vader_eager_limit" || var == "btl_sm_eager_limit")) {
        limit = read_cvar(i, type);
      }
    }
  }
  MPI_T_finalize();
  return std::max<int64_t>(0, limit);
}

}  // namespace

int64_t shared_memory_eager_limit() {
  static const int64_t limit = read_eager_limit();
  return limit;
}

std::string error_string(int code) {
  char text[MPI_MAX_ERROR_STRING] = {0};
  int len = 0;
  if (MPI_Error_string(code, text, &len) != MPI_SUCCESS) return str_cat("MPI error ", code);
  return std::string(text, len);
}

}  // namespace mpi_backend

void finalize_mpi() { mpi_backend::finalize(/*at_exit=*/false); }

}  // namespace comm
}  // namespace meshtrain
