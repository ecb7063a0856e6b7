#pragma once
// QueuedCommunicator: what every backend's communicator shares: the member
// list, error labels, and the execution of operations (the argument checks
// run before, in Communicator's public calls: checks.h).
//
// Execution: operations are queued in submission order and run one at a time,
// by a worker thread or, when a caller waits on the operation at the head of an
// idle queue, inline on the caller's thread (no hand-off for synchronous calls).
// Each running operation has a sequence number, identical on every rank (op_seq()).
// After a CommError the communicator refuses further work, repeating the cause.
//
// Note [Synchronous calls]
// The synchronous helpers (all_reduce(), barrier(), ...) wait at once for the
// operation they submit, which then runs inline when the queue is idle. Waking
// the worker thread for it would only make the worker race the caller for the
// lock and take a core the peers need (two context switches per operation,
// most of a small shared-memory collective's cost), so enqueue() leaves the
// worker asleep when a SyncCall is active on the calling thread and the queue
// is idle; and finished operations wake only their waiters, not the worker.


#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "meshtrain/comm.h"

namespace meshtrain {
namespace comm {

class OpWork;

// Marks the calling thread as about to wait for what it submits (see the Note).
class SyncCall {
 public:
  SyncCall() : previous_(active_) { active_ = true; }
  ~SyncCall() { active_ = previous_; }
  static bool active() { return active_; }

 private:
  bool previous_;
  static thread_local bool active_;
};

class QueuedCommunicator : public Communicator {
 public:
  QueuedCommunicator(std::vector<int> global_ranks, int rank, CommOptions options);
  ~QueuedCommunicator() override;

  int rank() const override { return rank_; }
  int size() const override { return static_cast<int>(global_ranks_.size()); }
  const std::vector<int>& global_ranks() const override { return global_ranks_; }
  const CommOptions& options() const override { return options_; }

 protected:
  friend class OpWork;
  using Body = std::function<void(std::vector<at::Tensor>& result)>;

  // Queues `body` as operation `name`; the Work's wait() runs or awaits it.
  WorkPtr enqueue(OpKind kind, const char* name, Body body);
  // Derived destructors call this first: no operation may run on a half-destroyed object.
  void stop_worker();
  // Sequence number of the running operation (valid inside a Body).
  uint64_t op_seq() const { return seq_; }
  // Name of the running operation ("" between operations).
  const char* running_op() const { return running_op_.load(); }

  // Labels for messages: "all_reduce on communicator 'tp' (rank 1 of 2, global rank 3)".
  std::string where(const char* op) const;
  std::string peer_name(int peer) const;

  std::vector<int> global_ranks_;
  int rank_;
  CommOptions options_;

 private:
  void worker_loop();
  // Runs the head of the queue if nothing runs; returns false otherwise. Holds lock.
  bool try_run_head(std::unique_lock<std::mutex>& lock, OpWork* only_if);
  void run_op(OpWork& op);

  std::mutex mutex_;
  std::condition_variable work_cv_;  // the worker: work was queued, or stop
  std::condition_variable done_cv_;  // waiters: an operation finished
  std::deque<std::shared_ptr<OpWork>> queue_;
  bool running_ = false;
  bool stopping_ = false;
  uint64_t seq_ = 0;           // sequence number of the running op
  std::string broken_;         // non-empty after a communication error
  std::atomic<const char*> running_op_{""};
  std::thread worker_;
};

}  // namespace comm
}  // namespace meshtrain
