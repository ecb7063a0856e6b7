#pragma once
// meshtrain/comm.h: communicators: collectives, point to point and sub-groups; the errors that name a peer; init_from_env; traffic counts; tuning.
// Part of the public API (meshtrain/meshtrain.h includes it); the sections below
// are in dependency order.

#include <ATen/core/Tensor.h>

#include <array>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

// ===== traffic =====
// Traffic accounting: per operation kind, the number of calls and the payload
// bytes this rank actually sent and received (the algorithm's real bytes: a ring
// all-reduce of S bytes on n ranks sends 2(n-1)/n * S). The small headers that
// verify arguments across ranks are counted apart, under "verify", so the
// per-operation rows match the algorithms' analytic volumes exactly. The part
// of each row exchanged with ranks on other hosts is counted too (inter_host_*):
// the link between machines is the scarce one.

namespace meshtrain {
namespace comm {

enum class OpKind : int {
  kSend = 0,
  kRecv,
  kBroadcast,
  kAllReduce,
  kReduce,
  kAllGather,
  kReduceScatter,
  kGather,
  kScatter,
  kAllToAll,
  kBarrier,
  kVerify,
  kCount  // number of kinds; not an operation
};
constexpr int kNumOpKinds = static_cast<int>(OpKind::kCount);

const char* op_name(OpKind kind);

struct OpTraffic {
  int64_t calls = 0;
  int64_t bytes_sent = 0;
  int64_t bytes_received = 0;
  int64_t inter_host_sent = 0;  // of bytes_sent, to ranks on other hosts
  int64_t inter_host_received = 0;
  OpTraffic& operator+=(const OpTraffic& o);
  OpTraffic& operator-=(const OpTraffic& o);
};

// A snapshot of one communicator's counters.
struct Traffic {
  std::array<OpTraffic, kNumOpKinds> ops{};

  const OpTraffic& operator[](OpKind k) const { return ops[static_cast<int>(k)]; }
  OpTraffic& operator[](OpKind k) { return ops[static_cast<int>(k)]; }
  // Sum over all kinds except kVerify (the payload the algorithms moved).
  OpTraffic payload_total() const;
  Traffic operator-(const Traffic& before) const;
  Traffic operator+(const Traffic& other) const;
  // A table with one row per kind that was used: calls, bytes sent, bytes received.
  std::string table(const std::string& title = "") const;
};

// Thread-safe counters (the worker thread and the caller both record).
class TrafficCounter {
 public:
  void add_call(OpKind kind);
  // `remote`: the peer is on another host.
  void add_sent(OpKind kind, int64_t bytes, bool remote = false);
  void add_received(OpKind kind, int64_t bytes, bool remote = false);
  // Adds every row of `t`, calls included.
  void add(const Traffic& t);
  Traffic snapshot() const;
  void reset();

 private:
  mutable std::mutex mutex_;
  Traffic traffic_;
};

// ===== tuning =====
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

// ===== errors =====
// Errors raised by communication. Every blocking operation ends in one of these
// instead of hanging: a dead peer gives PeerFailure within seconds, a stuck peer
// gives TimeoutError at the communicator's timeout, and collectives whose
// arguments differ across ranks give MismatchError on every rank.

// Base class of all communication failures. After one of these the communicator
// that raised it is unusable (its peers are in an unknown state).
class CommError : public std::runtime_error {
 public:
  explicit CommError(const std::string& what) : std::runtime_error(what) {}
};

// A peer process died (its connection to the store or to this rank closed).
// `rank()` is the peer's global rank, or -1 when it could not be determined.
class PeerFailure : public CommError {
 public:
  PeerFailure(const std::string& what, int rank) : CommError(what), rank_(rank) {}
  int rank() const { return rank_; }

 private:
  int rank_;
};

// No progress within the timeout: a peer is alive but stuck, or never called
// the matching operation.
class TimeoutError : public CommError {
 public:
  explicit TimeoutError(const std::string& what) : CommError(what) {}
};

// Ranks called the same collective with different kinds, dtypes, shapes or roots.
class MismatchError : public CommError {
 public:
  explicit MismatchError(const std::string& what) : CommError(what) {}
};

// ===== communicator =====
// meshtrain::comm::Communicator: the one communication interface every strategy
// uses. Backend-neutral (shared memory inside a host, Gloo over TCP, OpenMPI,
// and the hierarchical composition of shared memory and Gloo), passed
// in explicitly (never global), split into sub-communicators for mesh axes, and
// every byte it moves is counted (traffic()).
//
// Semantics follow torch.distributed: collectives are called by every member in
// the same order; in-place where torch is in place (broadcast, all_reduce,
// reduce); the *_async variants return a Work whose wait() completes the
// operation and rethrows its error. Operations on one communicator run in
// submission order on one worker thread, so async collectives overlap with the
// caller's computation (DDP's bucketed all-reduce during backward).
//
// Failure is loud: a dead peer raises PeerFailure, a stuck one TimeoutError, and
// mismatched arguments across ranks MismatchError on every rank (see errors.h).

enum class ReduceOp { kSum, kAvg, kMax, kMin, kProduct };
const char* reduce_op_name(ReduceOp op);

// An operation in flight.
class Work {
 public:
  virtual ~Work() = default;
  // Blocks until the operation completed; rethrows its error. Idempotent.
  virtual void wait() = 0;
  virtual bool is_completed() = 0;
  // Tensors produced by the operation (documented per operation); valid after wait().
  const std::vector<at::Tensor>& result() const { return result_; }

 protected:
  std::vector<at::Tensor> result_;
};
using WorkPtr = std::shared_ptr<Work>;

// MESHTRAIN_COMM_TIMEOUT (seconds) when set, else 5 minutes. ConfigError
// naming the variable when it is not a positive number.
std::chrono::milliseconds default_comm_timeout();

struct CommOptions {
  // Every blocking wait gives up after this long with a TimeoutError
  // (the trainer's --comm-timeout; sub-communicators inherit it).
  std::chrono::milliseconds timeout{default_comm_timeout()};
  // Exchange a small header before each collective so that ranks passing
  // different kinds, dtypes, shapes or roots get a MismatchError instead of a
  // crash or a hang. Costs one round of small messages per collective;
  // operations whose sizes differ by rank (uneven all_gather, gather) exchange
  // the header regardless, because they need the sizes.
  bool verify = true;
  // A name for error messages and traffic tables ("world", "dp", "tp", ...).
  std::string label = "world";
  // Collectives whose per-peer payload is at most this many bytes travel inside
  // the header round: one round of messages instead of a ring's 2(n-1) steps.
  // Must be equal on all ranks.
  int64_t inline_bytes = 32 * 1024;
  // "auto", "shm", "gloo" or "mpi"; empty: MESHTRAIN_BACKEND, else auto (see
  // docs/comm.md: shared memory for the ranks of one host, hierarchical across
  // hosts, MPI under mpirun). Sub-communicators choose again for their members.
  std::string backend;
  // The backends' tunables (CommTuning, above): from the environment unless set here;
  // sub-communicators inherit them. They change timings, never results.
  CommTuning tuning = CommTuning::from_env();

  CommOptions& set_backend(std::string b) { backend = std::move(b); return *this; }
};

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Global rank of each member, in this communicator's rank order.
  virtual const std::vector<int>& global_ranks() const = 0;
  virtual const CommOptions& options() const = 0;
  virtual std::string backend() const = 0;
  const std::string& label() const { return options().label; }

  // ---- point to point. A message carries its dtype and shape, so a receiver
  // may take a tensor whose shape it does not know (irecv_any), and a receive
  // into a tensor of another shape is an error, not memory corruption.
  // Messages between two ranks with the same tag arrive in the order sent.
  WorkPtr isend(const at::Tensor& tensor, int dst, int tag = 0);
  // Receives into `tensor` (its shape and dtype must match the sender's).
  WorkPtr irecv(at::Tensor tensor, int src, int tag = 0);
  // Receives a tensor of any shape and dtype; result()[0] after wait().
  WorkPtr irecv_any(int src, int tag = 0);

  // ---- collectives (asynchronous forms; synchronous helpers below). Every
  // call checks its arguments first: a ConfigError on the caller's thread,
  // naming the bad value, before any communication (checks.cpp, once for
  // every backend), and the communicator stays usable.
  // tensor on every rank := tensor on root.
  WorkPtr broadcast_async(at::Tensor tensor, int root);
  // tensor := op over ranks of tensor (ring: reduce-scatter then all-gather).
  WorkPtr all_reduce_async(at::Tensor tensor, ReduceOp op = ReduceOp::kSum);
  // tensor on root := op over ranks; other ranks' tensors are left unchanged.
  WorkPtr reduce_async(at::Tensor tensor, int root, ReduceOp op = ReduceOp::kSum);
  // Concatenates every rank's flattened input in rank order; inputs may differ
  // in size and shape. result()[0] is the flat concatenation (into `output`
  // when given: it must hold exactly the total), result()[1 + r] rank r's
  // tensor with its shape (a view of result()[0]).
  WorkPtr all_gather_async(const at::Tensor& input, at::Tensor output = {});
  // `input` is the same-sized flat buffer on every rank; rank r receives shard r
  // of op over ranks, with shard sizes `counts` (default: shard_sizes(numel,
  // size()), so sizes that do not divide evenly are fine). result()[0] is the
  // shard (in `output` when given). Ring traffic: (n-1)/n of the buffer.
  WorkPtr reduce_scatter_async(const at::Tensor& input, ReduceOp op = ReduceOp::kSum,
                                       at::Tensor output = {},
                                       std::vector<int64_t> counts = {});
  // On root, result()[r] is rank r's input (sizes may differ); elsewhere empty.
  WorkPtr gather_async(const at::Tensor& input, int root);
  // output on rank r := inputs[r] of root (inputs only read on root).
  WorkPtr scatter_async(at::Tensor output, std::vector<at::Tensor> inputs, int root);
  // inputs[r] goes to rank r; result()[r] is what rank r sent here. Sizes may differ.
  WorkPtr all_to_all_async(std::vector<at::Tensor> inputs);
  WorkPtr barrier_async();

  // ---- sub-communicators. Collective over this communicator: every member
  // calls it. Members with the same color form one group, ordered by (key,
  // rank); color < 0 means "in no group" and returns nullptr.
  virtual std::shared_ptr<Communicator> split(int color, int key, const std::string& label) = 0;
  // The group of `ranks` (ranks of this communicator, in the new rank order);
  // every member calls it, non-members get nullptr.
  std::shared_ptr<Communicator> split(const std::vector<int>& ranks, const std::string& label);

  // ---- synchronous helpers (torch.distributed names).
  void send(const at::Tensor& tensor, int dst, int tag = 0);
  void recv(at::Tensor tensor, int src, int tag = 0);
  at::Tensor recv_any(int src, int tag = 0);
  void broadcast(at::Tensor tensor, int root);
  void all_reduce(at::Tensor tensor, ReduceOp op = ReduceOp::kSum);
  void reduce(at::Tensor tensor, int root, ReduceOp op = ReduceOp::kSum);
  // Every rank's tensor, each with its own shape.
  std::vector<at::Tensor> all_gather(const at::Tensor& input);
  // Equal sizes, into one flat tensor (torch's all_gather_into_tensor):
  // output.numel() == size() * input.numel().
  void all_gather_into(at::Tensor output, const at::Tensor& input);
  // Uneven sizes: the flat concatenation of every rank's input.
  at::Tensor all_gather_flat(const at::Tensor& input);
  at::Tensor reduce_scatter(const at::Tensor& input, ReduceOp op = ReduceOp::kSum,
                            std::vector<int64_t> counts = {});
  // Equal shards (torch's reduce_scatter_tensor): input.numel() == size() * output.numel().
  void reduce_scatter_into(at::Tensor output, const at::Tensor& input,
                           ReduceOp op = ReduceOp::kSum);
  std::vector<at::Tensor> gather(const at::Tensor& input, int root);
  void scatter(at::Tensor output, const std::vector<at::Tensor>& inputs, int root);
  std::vector<at::Tensor> all_to_all(const std::vector<at::Tensor>& inputs);
  // Equal splits along dim 0: chunk r of input goes to rank r, chunk r of output came from rank r.
  void all_to_all_single(at::Tensor output, const at::Tensor& input);
  void barrier();

  // ---- accounting.
  virtual Traffic traffic() const { return counter_.snapshot(); }
  // What this communicator chose for this host and why, one line per choice
  // ("" when it tunes nothing); bench_collectives prints it.
  virtual std::string tuning() const { return ""; }
  virtual void reset_traffic() { counter_.reset(); }

 protected:
  // What a backend implements: the operations above, each called with its
  // arguments already checked (tensors defined, on the CPU, of a supported
  // dtype; roots, peers and tags in range; sizes consistent) and
  // reduce_scatter's `counts` filled in (shard_sizes by default).
  virtual WorkPtr start_send(const at::Tensor& tensor, int dst, int tag) = 0;
  virtual WorkPtr start_recv(at::Tensor tensor, int src, int tag) = 0;
  virtual WorkPtr start_recv_any(int src, int tag) = 0;
  virtual WorkPtr start_broadcast(at::Tensor tensor, int root) = 0;
  virtual WorkPtr start_all_reduce(at::Tensor tensor, ReduceOp op) = 0;
  virtual WorkPtr start_reduce(at::Tensor tensor, int root, ReduceOp op) = 0;
  virtual WorkPtr start_all_gather(const at::Tensor& input, at::Tensor output) = 0;
  virtual WorkPtr start_reduce_scatter(const at::Tensor& input, ReduceOp op, at::Tensor output,
                                       std::vector<int64_t> counts) = 0;
  virtual WorkPtr start_gather(const at::Tensor& input, int root) = 0;
  virtual WorkPtr start_scatter(at::Tensor output, std::vector<at::Tensor> inputs, int root) = 0;
  virtual WorkPtr start_all_to_all(std::vector<at::Tensor> inputs) = 0;
  virtual WorkPtr start_barrier() = 0;

  TrafficCounter counter_;
};

using CommPtr = std::shared_ptr<Communicator>;

// Byte strings of any length from every rank, in rank order (collectives over
// all_gather and gather: every rank calls them).
std::vector<std::string> all_gather_strings(Communicator& comm, const std::string& mine);
// On `root` every rank's string; elsewhere an empty vector.
std::vector<std::string> gather_strings(Communicator& comm, const std::string& mine, int root);

// ===== rendezvous =====
// Joining a job. A process learns its rank, the world size and where the
// rendezvous store is from (in this order of precedence):
//   1. torchrun-style variables: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
//      MASTER_ADDR, MASTER_PORT (set by meshrun and torchrun);
//   2. OpenMPI's: OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK, _LOCAL_SIZE
//      (MASTER_ADDR defaults to 127.0.0.1 when the job is on one node);
//   3. Slurm's: SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID (master: MASTER_ADDR,
//      else the first host of SLURM_JOB_NODELIST);
//   4. none of these: a world of one process.
// or explicitly with the article's init method "tcp://host:port" plus a rank
// and a world size. Rank 0 hosts the store at MASTER_ADDR:MASTER_PORT (bound to
// that address only), unless the launcher hosts it (MESHTRAIN_AGENT_STORE=1).
// A job started by mpirun runs on MPI (backend auto or mpi) and needs no store.

struct DistEnv {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  // Which convention the values came from: "torchrun", "openmpi", "slurm", "single".
  std::string source = "single";
  // The launcher hosts the store; ranks only connect to it.
  bool agent_store = false;
  // Restart generation under meshrun (namespaces the store between attempts).
  int restart_count = 0;
};

using EnvLookup = std::function<std::optional<std::string>(const std::string&)>;

// Reads the variables through `lookup` (pure, for tests). Throws ConfigError
// naming the variable when values are missing, malformed or contradictory.
DistEnv parse_dist_env(const EnvLookup& lookup);
// The process environment.
DistEnv dist_env_from_process();
// "node[01-03,07],gpu5" -> "node01". Throws ConfigError on a malformed list.
std::string first_host_of_nodelist(const std::string& nodelist);
// Tasks on node `node` of Slurm's SLURM_TASKS_PER_NODE, e.g. "2(x3),1" -> 2 for nodes 0-2, 1 for node 3.
int slurm_tasks_on_node(const std::string& spec, int node);
// Parses "tcp://host:port" (IPv6 hosts in brackets). Throws ConfigError.
std::pair<std::string, int> parse_tcp_url(const std::string& url);

// Sets the intra-op thread count from OMP_NUM_THREADS (meshrun sets it to this
// rank's share of the cores), so BLAS and ATen threads do not oversubscribe;
// without it, to the share of the cores `env` gives this rank's node.
void apply_thread_settings(const DistEnv& env);
void apply_thread_settings();  // of this process's environment
// libtorch's intra-op threads and OpenBLAS's pool (when libblas.so.3 is
// OpenBLAS) set to n.
void set_compute_threads(int n);

// Joins the job described by the environment; returns the world communicator.
// Under mpirun with backend auto or mpi (CommOptions::backend, else
// MESHTRAIN_BACKEND), an MPI world; backend mpi without mpirun is a ConfigError.
CommPtr init_from_env(CommOptions options = {});
// Ends MPI in this process (MPI_Finalize), if meshtrain started it and its
// state allows (see docs/comm.md). It happens at normal exit anyway; call it
// in a process that ends with _exit, after its last communicator is gone
// (ConfigError otherwise). Every rank of the job must reach it. No-op without MPI.
void finalize_mpi();
// The article's init method: rank 0 hosts the store at host:port.
CommPtr init_tcp(const std::string& url, int rank, int world_size, CommOptions options = {});
// A world of one process (its own private store): single-process references.
CommPtr make_single_process_world(CommOptions options = {});
// Joins through a store that is already running at host:port (launchers, tests).
// `group` namespaces this job attempt's keys and failure labels.
CommPtr init_with_store(const std::string& host, int port, int rank, int world_size,
                        const std::string& group, CommOptions options = {});

// Posts `message`, an error that stops this process before its world is made
// (a ConfigError), to the job's rendezvous store, so that the ranks waiting
// there end now naming it instead of at their communication time-out (Note
// [Start-up reports] in src/comm/process.cpp). Only for ranks started with
// torchrun's variables and no launcher (RANK or WORLD_SIZE set, WORLD_SIZE not
// 1, MESHTRAIN_AGENT_STORE unset: meshrun sees its ranks exit itself), when
// the store at MASTER_ADDR:MASTER_PORT answers within a few seconds and takes
// this process's MESHTRAIN_RDZV_TOKEN; once per process (init_from_env posts
// its own errors). Never throws.
void report_startup_error(const std::string& message);

}  // namespace comm
}  // namespace meshtrain
