#pragma once
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

#include <ATen/core/Tensor.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "meshtrain/comm/traffic.h"
#include "meshtrain/comm/tuning.h"

namespace meshtrain {
namespace comm {

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
  // The backends' tunables (tuning.h): from the environment unless set here;
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

}  // namespace comm
}  // namespace meshtrain
