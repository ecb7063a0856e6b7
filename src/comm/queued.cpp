#include "queued.h"

#include <ATen/ATen.h>

#include "checks.h"
#include "header.h"
#include "meshtrain/comm.h"
#include "meshtrain/util.h"
#include "util/shard.h"

namespace meshtrain {
namespace comm {

// A queued operation. wait() may run the operation inline when it is at the
// head of an idle queue.
class OpWork : public Work {
 public:
  OpWork(QueuedCommunicator* comm, const char* name, QueuedCommunicator::Body body)
      : comm_(comm), name_(name), body_(std::move(body)) {}

  void wait() override {
    std::unique_lock<std::mutex> lock(comm_->mutex_);
    while (!done_) {
      if (!comm_->try_run_head(lock, this)) comm_->done_cv_.wait(lock);
    }
    if (error_) std::rethrow_exception(error_);
  }

  bool is_completed() override {
    std::lock_guard<std::mutex> lock(comm_->mutex_);
    return done_;
  }

 private:
  friend class QueuedCommunicator;
  QueuedCommunicator* comm_;
  const char* name_;
  QueuedCommunicator::Body body_;
  bool done_ = false;
  std::exception_ptr error_;
};

thread_local bool SyncCall::active_ = false;

QueuedCommunicator::QueuedCommunicator(std::vector<int> global_ranks, int rank, CommOptions options)
    : global_ranks_(std::move(global_ranks)), rank_(rank), options_(std::move(options)) {
  worker_ = std::thread([this] { worker_loop(); });
}

QueuedCommunicator::~QueuedCommunicator() { stop_worker(); }

void QueuedCommunicator::stop_worker() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  work_cv_.notify_all();
  if (worker_.joinable()) worker_.join();
}

WorkPtr QueuedCommunicator::enqueue(OpKind kind, const char* name, Body body) {
  counter_.add_call(kind);
  auto work = std::make_shared<OpWork>(this, name, std::move(body));
  bool idle;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    idle = queue_.empty() && !running_;
    queue_.push_back(work);
  }
  if (!(idle && SyncCall::active())) work_cv_.notify_one();  // See Note [Synchronous calls]
  return work;
}

bool QueuedCommunicator::try_run_head(std::unique_lock<std::mutex>& lock, OpWork* only_if) {
  if (running_ || queue_.empty()) return false;
  if (only_if && queue_.front().get() != only_if) return false;
  std::shared_ptr<OpWork> op = queue_.front();
  queue_.pop_front();
  running_ = true;
  const std::string broken = broken_;
  lock.unlock();
  if (!broken.empty()) {
    op->error_ = std::make_exception_ptr(CommError(
        str_cat(where(op->name_), ": the communicator is unusable after an earlier error: ", broken)));
  } else {
    running_op_ = op->name_;
    run_op(*op);
    running_op_ = "";
  }
  lock.lock();
  running_ = false;
  ++seq_;
  op->done_ = true;
  if (op->error_) {
    try {
      std::rethrow_exception(op->error_);
    } catch (const CommError& e) {
      if (broken_.empty()) broken_ = e.what();
    } catch (...) {
    }
  }
  op->body_ = nullptr;  // release the tensors it captured
  done_cv_.notify_all();
  if (!queue_.empty()) work_cv_.notify_one();  // the next one may have no waiter yet
  return true;
}

void QueuedCommunicator::run_op(OpWork& op) {
  try {
    op.body_(op.result_);
  } catch (const ConfigError&) {
    op.error_ = std::current_exception();
  } catch (const CommError&) {
    op.error_ = std::current_exception();
  } catch (const std::exception& e) {
    op.error_ = std::make_exception_ptr(CommError(str_cat(where(op.name_), ": ", e.what())));
  }
}

void QueuedCommunicator::worker_loop() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (true) {
    if (try_run_head(lock, nullptr)) continue;
    if (stopping_ && queue_.empty() && !running_) return;
    work_cv_.wait(lock);
  }
}

// ---- labels

std::string QueuedCommunicator::where(const char* op) const { return comm::where(*this, op); }

std::string QueuedCommunicator::peer_name(int peer) const { return comm::peer_name(*this, peer); }

}  // namespace comm
}  // namespace meshtrain
