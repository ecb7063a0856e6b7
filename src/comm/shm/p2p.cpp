// Point-to-point messages on the shared-memory backend.
//
// Note [Shared-memory rings]
// Each ordered pair (src, dst) has a ring of channel_bytes in the segment with
// two monotonic byte counters: head (advanced by src as it writes) and tail
// (advanced by dst as it reads). A message is a Frame (tag, dtype, shape)
// followed by its payload, padded to a cache line. isend writes the whole
// message at once when the ring has room and returns a completed Work: the
// usual case for pipeline activations, which then cost one copy in and one
// copy out and no waiting. A message that does not fit is handed to a sender
// thread (started on first need) that writes it as the receiver frees space,
// so a rank that posted a send and went on computing still delivers it.
//
// The receiver reads frames in order and matches them to posted receives by
// tag, first posted first served; a frame with no receive posted yet is read
// into a tensor of its announced shape and kept until one is (receives may
// take tags in any order; one tag's messages arrive in the order sent). A
// receive into a tensor of another shape or dtype still consumes the message,
// then raises MismatchError, so the ring stays in step.

#include <ATen/ATen.h>

#include <sys/mman.h>

#include <cstring>

#include "communicator.h"
#include "futex.h"
#include "meshtrain/comm.h"
#include "meshtrain/util.h"
#include "p2p.h"

namespace meshtrain {
namespace comm {
namespace shm_backend {

namespace {

// Copies between linear memory and a ring of `cap` bytes at logical position `pos`.
void ring_write(char* ring, uint64_t cap, uint64_t pos, const char* src, uint64_t len) {
  const uint64_t at = pos % cap, first = std::min(len, cap - at);
  std::memcpy(ring + at, src, first);
  if (len > first) std::memcpy(ring, src + first, len - first);
}

void ring_read(const char* ring, uint64_t cap, uint64_t pos, char* dst, uint64_t len) {
  const uint64_t at = pos % cap, first = std::min(len, cap - at);
  std::memcpy(dst, ring + at, first);
  if (len > first) std::memcpy(dst + first, ring, len - first);
}

// Page faults are expensive here (allocating a tmpfs page costs ~15 us in a
// VM): a ring's pages are faulted in once, in bulk, when the channel is first
// used, rather than message by message as the head advances through them.
void populate(char* begin, size_t bytes) {
#ifdef MADV_POPULATE_WRITE
  madvise(begin, bytes, MADV_POPULATE_WRITE);  // best effort: older kernels fault page by page
#endif
}

class DoneWork : public Work {
 public:
  explicit DoneWork(std::vector<at::Tensor> result) { result_ = std::move(result); }
  void wait() override {}
  bool is_completed() override { return true; }
};

}  // namespace

class SendWork : public Work {
 public:
  SendWork(ShmCommunicator* comm, std::shared_ptr<SendOp> op) : comm_(comm), op_(std::move(op)) {}
  void wait() override {
    std::unique_lock<std::mutex> lock(comm_->sender_mutex_);
    const auto deadline = std::chrono::steady_clock::now() + comm_->options_.timeout;
    while (!op_->done && !op_->error) {
      comm_->sender_cv_.wait_for(lock, std::chrono::milliseconds(100));
      if (op_->done || op_->error) break;
      if (auto f = comm_->process_->failure()) Process::raise_failure(comm_->where("send"), *f);
      if (std::chrono::steady_clock::now() > deadline) {
        throw TimeoutError(str_cat(comm_->where("send"), ": no progress for ", comm_->options_.timeout.count(),
                                   " ms sending to ", comm_->peer_name(op_->dst),
                                   ", which did not receive the message (tag ", op_->frame.tag, ")"));
      }
    }
    if (op_->error) std::rethrow_exception(op_->error);
  }
  bool is_completed() override {
    std::lock_guard<std::mutex> lock(comm_->sender_mutex_);
    return op_->done || op_->error;
  }

 private:
  ShmCommunicator* comm_;
  std::shared_ptr<SendOp> op_;
};

class RecvWork : public Work {
 public:
  RecvWork(ShmCommunicator* comm, std::shared_ptr<RecvOp> op, int src) : comm_(comm), op_(std::move(op)), src_(src) {}
  void wait() override {
    Inbox& inbox = *comm_->inbox_[src_];
    ChannelCtrl& ch = comm_->channel(src_, comm_->rank_);
    while (!op_->done.load(std::memory_order_acquire)) {
      uint64_t seen = 0;
      {
        std::lock_guard<std::mutex> lock(inbox.mutex);
        comm_->pull(src_, inbox);
        if (op_->done.load(std::memory_order_acquire)) break;
        seen = inbox.seen_head;
      }
      comm_->wait_until(
          [&] { return ch.head.load(std::memory_order_acquire) != seen || op_->done.load(std::memory_order_acquire); },
          "recv", [&] { return src_; }, "a message", "that rank is stuck, or never sent it");
    }
    if (op_->error) std::rethrow_exception(op_->error);
    result_ = {op_->result};
  }
  bool is_completed() override { return op_->done.load(); }

 private:
  ShmCommunicator* comm_;
  std::shared_ptr<RecvOp> op_;
  int src_;
};

// ---- sending

WorkPtr ShmCommunicator::start_send(const at::Tensor& tensor, int dst, int tag) {
  counter_.add_call(OpKind::kSend);
  auto op = std::make_shared<SendOp>();
  op->dst = dst;
  op->data = tensor.contiguous();
  op->frame.tag = tag;
  op->frame.payload = static_cast<int64_t>(op->data.nbytes());
  op->frame.desc = header_of(op->data, OpKind::kSend);
  op->total = kFrameBytes + round_up(op->data.nbytes(), kLine);
  counter_.add_sent(OpKind::kSend, op->frame.payload);
  counter_.add_sent(OpKind::kVerify, kFrameBytes);
  {
    std::lock_guard<std::mutex> lock(*send_mutex_[dst]);
    if (!sent_before_[dst]) {
      populate(channel_data(rank_, dst), layout_.channel_bytes);
      sent_before_[dst] = true;
    }
    if (pending_[dst].empty() && push(*op)) return std::make_shared<DoneWork>(std::vector<at::Tensor>{});
    pending_[dst].push_back(op);
  }
  start_sender();
  return std::make_shared<SendWork>(this, op);
}

bool ShmCommunicator::push(SendOp& op) {
  ChannelCtrl& ch = channel(rank_, op.dst);
  char* ring = channel_data(rank_, op.dst);
  const uint64_t cap = layout_.channel_bytes;
  const uint64_t head = ch.head.load(std::memory_order_relaxed);
  const uint64_t space = cap - (head - ch.tail.load(std::memory_order_acquire));
  uint64_t pos = head, left = std::min(space, op.total - op.written);
  if (left == 0) return op.written == op.total;
  // The message's bytes in order: frame (padded), payload, padding.
  while (left > 0) {
    uint64_t n;
    if (op.written < kFrameBytes) {
      char frame[kFrameBytes] = {0};
      std::memcpy(frame, &op.frame, sizeof(Frame));
      n = std::min(left, kFrameBytes - op.written);
      ring_write(ring, cap, pos, frame + op.written, n);
    } else if (op.written < kFrameBytes + static_cast<uint64_t>(op.frame.payload)) {
      const uint64_t off = op.written - kFrameBytes;
      n = std::min(left, static_cast<uint64_t>(op.frame.payload) - off);
      ring_write(ring, cap, pos, static_cast<const char*>(op.data.data_ptr()) + off, n);
    } else {
      n = std::min(left, op.total - op.written);  // padding: nothing to write
    }
    pos += n;
    op.written += n;
    left -= n;
  }
  ch.head.store(pos, std::memory_order_release);
  wake(op.dst);
  if (op.written == op.total) op.data = at::Tensor();
  return op.written == op.total;
}

void ShmCommunicator::start_sender() {
  std::lock_guard<std::mutex> lock(sender_mutex_);
  if (!sender_.joinable()) sender_ = std::thread([this] { sender_loop(); });
  sender_cv_.notify_all();
}

void ShmCommunicator::sender_loop() {
  while (true) {
    std::vector<int> blocked;  // destinations whose ring is full
    bool progressed = false;
    for (int dst = 0; dst < size(); ++dst) {
      std::lock_guard<std::mutex> lock(*send_mutex_[dst]);
      while (!pending_[dst].empty()) {
        SendOp& op = *pending_[dst].front();
        const uint64_t before = op.written;
        const bool done = push(op);
        progressed = progressed || op.written != before;
        if (!done) {
          blocked.push_back(dst);
          break;
        }
        {
          std::lock_guard<std::mutex> s(sender_mutex_);
          op.done = true;
        }
        sender_cv_.notify_all();
        pending_[dst].pop_front();
      }
    }
    if (progressed) continue;
    if (blocked.empty()) {
      std::unique_lock<std::mutex> lock(sender_mutex_);
      if (sender_stop_) return;
      sender_cv_.wait_for(lock, std::chrono::milliseconds(100));
      continue;
    }
    {
      std::lock_guard<std::mutex> lock(sender_mutex_);
      if (sender_stop_) {
        fail_p2p(std::make_exception_ptr(CommError(str_cat(where("send"), ": the communicator was destroyed "
                                                                          "before the message was received"))));
        return;
      }
    }
    try {
      const uint64_t cap = layout_.channel_bytes;
      wait_until(
          [&] {
            if (sender_stop_) return true;
            for (int dst : blocked) {
              const ChannelCtrl& ch = channel(rank_, dst);
              if (ch.head.load(std::memory_order_relaxed) - ch.tail.load(std::memory_order_acquire) < cap) return true;
            }
            return false;
          },
          "send", [&] { return blocked.front(); }, "room in its receive ring",
          "that rank is stuck, or never receives the message");
    } catch (const CommError&) {
      fail_p2p(std::current_exception());
    }
  }
}

void ShmCommunicator::fail_p2p(const std::exception_ptr& error) {
  for (int dst = 0; dst < size(); ++dst) {
    std::lock_guard<std::mutex> lock(*send_mutex_[dst]);
    for (auto& op : pending_[dst]) {
      std::lock_guard<std::mutex> s(sender_mutex_);
      op->error = error;
    }
    pending_[dst].clear();
  }
  sender_cv_.notify_all();
}

// ---- receiving

WorkPtr ShmCommunicator::start_recv(at::Tensor tensor, int src, int tag) {
  counter_.add_call(OpKind::kRecv);
  auto op = std::make_shared<RecvOp>();
  op->tag = tag;
  op->target = tensor;
  {
    Inbox& inbox = *inbox_[src];
    std::lock_guard<std::mutex> lock(inbox.mutex);
    inbox.posted.push_back(op);
    pull(src, inbox);  // also delivers a message that arrived before this receive
  }
  return std::make_shared<RecvWork>(this, op, src);
}

WorkPtr ShmCommunicator::start_recv_any(int src, int tag) {
  MESHTRAIN_CHECK(tag >= 0 && tag < (1 << 30), where("recv"), ": tag ", tag, " out of range [0, 2^30)");
  counter_.add_call(OpKind::kRecv);
  auto op = std::make_shared<RecvOp>();
  op->tag = tag;
  {
    Inbox& inbox = *inbox_[src];
    std::lock_guard<std::mutex> lock(inbox.mutex);
    inbox.posted.push_back(op);
    pull(src, inbox);
  }
  return std::make_shared<RecvWork>(this, op, src);
}

namespace {

// Hands a complete message to a receive: copies into its tensor, or raises
// MismatchError in the receive when the shapes differ.
void deliver(RecvOp& op, const at::Tensor& message, const std::string& where, const std::string& from) {
  if (!op.target.defined()) {
    op.result = message;
  } else if (message.scalar_type() != op.target.scalar_type() || message.sizes() != op.target.sizes()) {
    op.error = std::make_exception_ptr(MismatchError(
        str_cat(where, ": ", from, " sent ", describe(header_of(message, OpKind::kSend)), " with tag ", op.tag,
                " but the receiving tensor is ", describe(header_of(op.target, OpKind::kSend)))));
  } else {
    if (!message.is_same(op.target)) op.target.copy_(message);
    op.result = op.target;
  }
  op.done.store(true, std::memory_order_release);
}

// The first posted receive for `tag`, removed from the queue; null if none.
std::shared_ptr<RecvOp> take_posted(Inbox& inbox, int tag) {
  for (auto it = inbox.posted.begin(); it != inbox.posted.end(); ++it) {
    if ((*it)->tag != tag) continue;
    auto op = *it;
    inbox.posted.erase(it);
    return op;
  }
  return nullptr;
}

}  // namespace

void ShmCommunicator::pull(int src, Inbox& inbox) {
  if (!inbox.populated) {
    populate(channel_data(src, rank_), layout_.channel_bytes);
    inbox.populated = true;
  }
  // Receives posted after their message arrived.
  for (auto it = inbox.arrived.begin(); it != inbox.arrived.end();) {
    if (auto op = take_posted(inbox, it->first)) {
      deliver(*op, it->second, where("recv"), peer_name(src));
      it = inbox.arrived.erase(it);
      wake(rank_);
    } else {
      ++it;
    }
  }
  ChannelCtrl& ch = channel(src, rank_);
  const char* ring = channel_data(src, rank_);
  const uint64_t cap = layout_.channel_bytes;
  uint64_t tail = ch.tail.load(std::memory_order_relaxed);
  while (true) {
    const uint64_t head = ch.head.load(std::memory_order_acquire);
    inbox.seen_head = head;
    Incoming& in = inbox.current;
    if (!in.active) {
      if (head - tail < kFrameBytes) break;
      ring_read(ring, cap, tail, reinterpret_cast<char*>(&in.frame), sizeof(Frame));
      const Header& d = in.frame.desc;
      if (in.frame.magic != Frame().magic || d.ndim < 0 || d.ndim > 8 || !supported_dtype(static_cast<at::ScalarType>(d.dtype))) {
        throw CommError(str_cat(where("recv"), ": malformed message from ", peer_name(src)));
      }
      tail += kFrameBytes;
      counter_.add_received(OpKind::kVerify, kFrameBytes);
      in.active = true;
      in.received = 0;
      in.op = take_posted(inbox, in.frame.tag);
      const bool direct = in.op && in.op->target.defined() && in.op->target.is_contiguous() &&
                          static_cast<int32_t>(in.op->target.scalar_type()) == d.dtype && in.op->target.sizes() == at::IntArrayRef(shape_of(d));
      in.landing = direct ? in.op->target
                          : at::empty(shape_of(d), at::TensorOptions().dtype(static_cast<at::ScalarType>(d.dtype)));
    }
    const uint64_t payload = static_cast<uint64_t>(in.frame.payload);
    const uint64_t padded = round_up(payload, kLine);
    const uint64_t n = std::min(head - tail, padded - in.received);
    if (n == 0 && in.received < padded) break;
    if (in.received < payload) {
      const uint64_t take = std::min(n, payload - in.received);
      ring_read(ring, cap, tail, static_cast<char*>(in.landing.data_ptr()) + in.received, take);
    }
    tail += n;
    in.received += n;
    ch.tail.store(tail, std::memory_order_release);
    wake(src);  // its sender may wait for room
    if (in.received < padded) break;
    counter_.add_received(OpKind::kRecv, static_cast<int64_t>(payload));
    in.active = false;
    // A receive posted while the payload was arriving takes it now: left among
    // the arrived messages, it would wait for a later pull that a sender with
    // nothing more to send never causes.
    if (!in.op) in.op = take_posted(inbox, in.frame.tag);
    if (in.op) {
      deliver(*in.op, in.landing, where("recv"), peer_name(src));
      wake(rank_);  // another thread may wait on this receive
    } else {
      inbox.arrived.emplace_back(in.frame.tag, in.landing);
    }
    in.op.reset();
    in.landing = at::Tensor();
  }
  ch.tail.store(tail, std::memory_order_release);
}

}  // namespace shm_backend
}  // namespace comm
}  // namespace meshtrain
