#include "queued.h"

#include <ATen/ATen.h>

#include "header.h"
#include "meshtrain/comm/errors.h"
#include "meshtrain/util/error.h"
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

std::string QueuedCommunicator::where(const char* op) const {
  return str_cat(op, " on communicator '", options_.label, "' (rank ", rank_, " of ", size(),
                 ", global rank ", global_ranks_[rank_], ")");
}

std::string QueuedCommunicator::peer_name(int peer) const {
  return str_cat("rank ", peer, " (global rank ", global_ranks_[peer], ")");
}

// ---- argument checks

void QueuedCommunicator::check_tensor(const at::Tensor& t, const char* op, const char* what) const {
  MESHTRAIN_CHECK(t.defined(), where(op), ": ", what, " is an undefined tensor");
  MESHTRAIN_CHECK(t.device().is_cpu(), where(op), ": ", what, " is on ", t.device(), "; the ", backend(),
                  " backend moves CPU tensors only (call .cpu() first)");
  MESHTRAIN_CHECK(supported_dtype(t.scalar_type()), where(op), ": dtype ", t.scalar_type(),
                  " is not supported; use float32, float64, bfloat16, float16, int32, int64, int8 or uint8");
  MESHTRAIN_CHECK(t.dim() <= 8, where(op), ": ", what, " has ", t.dim(), " dims; at most 8 are supported (reshape first)");
}

void QueuedCommunicator::check_root(int root, const char* op) const {
  MESHTRAIN_CHECK(root >= 0 && root < size(), where(op), ": root ", root, " is not a rank of ",
                  "this communicator; use a root in [0, ", size(), ")");
}

void QueuedCommunicator::check_peer(int peer, const char* op) const {
  MESHTRAIN_CHECK(peer >= 0 && peer < size() && peer != rank_, where(op), ": peer ", peer,
                  " is invalid; use a rank in [0, ", size(), ") other than this rank (", rank_, ")");
}

void QueuedCommunicator::check_reduce_op(ReduceOp op, const at::Tensor& t, const char* name) const {
  MESHTRAIN_CHECK(op != ReduceOp::kAvg || at::isFloatingType(t.scalar_type()), where(name),
                  ": ReduceOp::kAvg needs a floating dtype, got ", t.scalar_type(), "; reduce with kSum and divide");
}

void QueuedCommunicator::check_p2p(const at::Tensor& tensor, int peer, int tag, const char* op) const {
  check_tensor(tensor, op, "tensor");
  check_peer(peer, op);
  MESHTRAIN_CHECK(tag >= 0 && tag < (1 << 30), where(op), ": tag ", tag, " out of range [0, 2^30)");
}

void QueuedCommunicator::check_reduce_scatter(const at::Tensor& input, const at::Tensor& output,
                                              std::vector<int64_t>& counts) const {
  check_tensor(input, "reduce_scatter", "input");
  if (counts.empty()) counts = shard_sizes(input.numel(), size());
  int64_t sum = 0;
  for (auto c : counts) {
    MESHTRAIN_CHECK(c >= 0, where("reduce_scatter"), ": negative shard size ", c);
    sum += c;
  }
  MESHTRAIN_CHECK(static_cast<int>(counts.size()) == size() && sum == input.numel(), where("reduce_scatter"),
                  ": shard sizes must be one per rank (", size(), ") and sum to the input's ", input.numel(),
                  " elements; got ", counts.size(), " sizes summing to ", sum);
  if (output.defined()) {
    check_tensor(output, "reduce_scatter", "output");
    MESHTRAIN_CHECK(output.numel() == counts[rank_] && output.scalar_type() == input.scalar_type(),
                    where("reduce_scatter"), ": output must be ", input.scalar_type(), " with ", counts[rank_],
                    " elements (this rank's shard); got ", output.scalar_type(), " with ", output.numel());
  }
}

void QueuedCommunicator::check_all_gather(const at::Tensor& input, const at::Tensor& output) const {
  check_tensor(input, "all_gather", "input");
  if (output.defined()) {
    check_tensor(output, "all_gather", "output");
    MESHTRAIN_CHECK(output.scalar_type() == input.scalar_type(), where("all_gather"), ": output dtype ",
                    output.scalar_type(), " differs from input dtype ", input.scalar_type());
  }
}

void QueuedCommunicator::check_scatter(const at::Tensor& output, const std::vector<at::Tensor>& inputs,
                                       int root) const {
  check_tensor(output, "scatter", "output");
  check_root(root, "scatter");
  if (rank_ != root) return;
  MESHTRAIN_CHECK(static_cast<int>(inputs.size()) == size(), where("scatter"), ": root needs one input per rank (",
                  size(), "), got ", inputs.size());
  for (const auto& t : inputs) {
    check_tensor(t, "scatter", "input");
    MESHTRAIN_CHECK(t.scalar_type() == output.scalar_type(), where("scatter"), ": input dtype ", t.scalar_type(),
                    " differs from output dtype ", output.scalar_type());
  }
}

void QueuedCommunicator::check_all_to_all(const std::vector<at::Tensor>& inputs) const {
  MESHTRAIN_CHECK(static_cast<int>(inputs.size()) == size(), where("all_to_all"), ": needs one input per rank (",
                  size(), "), got ", inputs.size());
  for (const auto& t : inputs) {
    check_tensor(t, "all_to_all", "input");
    MESHTRAIN_CHECK(t.scalar_type() == inputs[0].scalar_type(), where("all_to_all"),
                    ": all inputs must share one dtype; got ", inputs[0].scalar_type(), " and ", t.scalar_type());
  }
}

}  // namespace comm
}  // namespace meshtrain
