// Point-to-point messages on the MPI backend.
//
// Note [MPI messages]
// A message is a Header (dtype, shape) on MPI tag 2t, followed, when the
// payload does not fit CommOptions::inline_bytes, by the payload on tag
// 2t + 1 (small payloads travel inside the header's message: one MPI message,
// as pipeline activations of small models mostly are; where header and
// payload exceed what MPI sends eagerly, the payload's rest follows on tag
// 2t + 1, as the header round's does: Note [MPI header round]). A receive posts its
// header receive at once, into a buffer of header + inline_bytes, so a
// message can never overrun it; the header names the payload's dtype and
// shape, so irecv_any receives a tensor of any shape, and a receive into a
// tensor of another shape still consumes the payload (into a temporary), then
// raises MismatchError.
//
// Order: MPI matches one sender's messages with one tag in the order sent,
// and posted receives in the order posted. Headers therefore pair with the
// receives of their (source, tag) in post order, and payloads would pair
// wrongly if two receives posted their payload receives out of that order; so
// the receives of one (source, tag) advance in post order, under the
// channel's mutex: a payload receive is posted only after every earlier
// header on the channel has arrived. A sender posts a message's two parts
// back to back, under one mutex, so two threads sending to one peer do not
// interleave them.
//
// Buffers belong to the communicator (sends_, the channels) until MPI is done
// with them, so a send whose Work is dropped unwaited is still delivered.

#include <ATen/ATen.h>

#include <cstring>

#include "communicator.h"
#include "meshtrain/comm.h"
#include "meshtrain/util.h"
#include "runtime.h"

namespace meshtrain {
namespace comm {
namespace mpi_backend {

using Clock = std::chrono::steady_clock;

struct SendOp {
  std::mutex mutex;  // MPI must not test one request from two threads at once
  int dst = -1;
  int tag = 0;
  at::Tensor message;  // header [+ inline payload]
  at::Tensor data;     // the payload, when it travels apart
  MPI_Request requests[2] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL};
  bool done = false;
  // Tests the requests (holding mutex); true when both completed.
  bool test(int& error) {
    if (done) return true;
    int flag = 0;
    error = MPI_Testall(2, requests, &flag, MPI_STATUSES_IGNORE);
    done = error == MPI_SUCCESS && flag != 0;
    return done;
  }
};

struct RecvOp {
  int tag = 0;
  at::Tensor target;  // irecv's tensor; undefined for irecv_any
  at::Tensor header;  // Header + inline capacity
  MPI_Request header_request = MPI_REQUEST_NULL;
  bool header_done = false;
  at::Tensor landing;  // where the payload goes
  MPI_Request payload_request = MPI_REQUEST_NULL;
  bool done = false;  // under the channel's mutex
  std::exception_ptr error;
  at::Tensor result;
};

namespace {

int header_tag(int tag) { return 2 * tag; }
int payload_tag(int tag) { return 2 * tag + 1; }

}  // namespace

class SendWork : public Work {
 public:
  SendWork(MpiCommunicator* comm, std::shared_ptr<SendOp> op) : comm_(comm), op_(std::move(op)) {}

  void wait() override {
    const auto deadline = Clock::now() + comm_->options_.timeout;
    Backoff backoff(comm_->spin_us_);
    while (true) {
      {
        std::lock_guard<std::mutex> lock(op_->mutex);
        int error = MPI_SUCCESS;
        if (op_->test(error)) return;
        comm_->check(error, "send", "MPI_Testall");
      }
      if (Clock::now() >= deadline) {
        throw TimeoutError(str_cat(comm_->where("send"), ": no progress for ", comm_->options_.timeout.count(),
                                   " ms sending to ", comm_->peer_name(op_->dst), ", which did not receive the ",
                                   "message (tag ", op_->tag, ")"));
      }
      backoff.pause();
    }
  }

  bool is_completed() override {
    std::lock_guard<std::mutex> lock(op_->mutex);
    int error = MPI_SUCCESS;
    return op_->test(error) || error != MPI_SUCCESS;
  }

 private:
  MpiCommunicator* comm_;
  std::shared_ptr<SendOp> op_;
};

class RecvWork : public Work {
 public:
  RecvWork(MpiCommunicator* comm, std::shared_ptr<RecvOp> op, int src)
      : comm_(comm), op_(std::move(op)), src_(src), channel_(comm->channel(src, op_->tag)) {}

  void wait() override {
    const auto deadline = Clock::now() + comm_->options_.timeout;
    Backoff backoff(comm_->spin_us_);
    while (!advance()) {
      if (Clock::now() >= deadline) {
        throw TimeoutError(str_cat(comm_->where("recv"), ": no message from ", comm_->peer_name(src_), " with tag ",
                                   op_->tag, " for ", comm_->options_.timeout.count(),
                                   " ms; that rank is stuck, or never sent it"));
      }
      backoff.pause();
    }
    if (op_->error) std::rethrow_exception(op_->error);
    result_ = {op_->result};
  }

  bool is_completed() override { return advance(); }

 private:
  bool advance() {
    std::lock_guard<std::mutex> lock(channel_.mutex);
    if (!op_->done) comm_->advance(channel_, src_, op_->tag);
    return op_->done;
  }

  MpiCommunicator* comm_;
  std::shared_ptr<RecvOp> op_;
  int src_;
  MpiCommunicator::Channel& channel_;
};

// ---- sending

WorkPtr MpiCommunicator::start_send(const at::Tensor& tensor, int dst, int tag) {
  const int count = mpi_count(tensor.numel(), "send");
  counter_.add_call(OpKind::kSend);
  auto op = std::make_shared<SendOp>();
  op->dst = dst;
  op->tag = tag;
  const at::Tensor data = tensor.contiguous();
  Header h = header_of(data, OpKind::kSend);
  const int64_t bytes = data.nbytes();
  const bool inline_payload = bytes <= options_.inline_bytes;
  h.inline_bytes = inline_payload ? bytes : 0;
  const int64_t total = static_cast<int64_t>(sizeof(Header)) + h.inline_bytes;
  const int64_t head = first_part(total);
  h.inline_after = static_cast<int32_t>(total - head);  // beyond the eager size: a second message
  op->message = at::empty({total}, at::kByte);
  char* message = static_cast<char*>(op->message.data_ptr());
  std::memcpy(message, &h, sizeof(Header));
  if (inline_payload && bytes > 0) std::memcpy(message + sizeof(Header), data.data_ptr(), bytes);
  if (!inline_payload && bytes > 0) op->data = data;
  {
    std::lock_guard<std::mutex> lock(post_mutex_);
    check(MPI_Isend(message, static_cast<int>(head), MPI_BYTE, dst, header_tag(tag), comm_, &op->requests[0]), "send",
          "MPI_Isend");
    // The second part: the rest of an inline payload, or the payload itself. If posting it fails,
    // the first part may still be read from op's buffers: they are kept for good.
    int rc = MPI_SUCCESS;
    if (h.inline_after > 0) {
      rc = MPI_Isend(message + head, h.inline_after, MPI_BYTE, dst, payload_tag(tag), comm_, &op->requests[1]);
    } else if (op->data.defined()) {
      rc = MPI_Isend(op->data.data_ptr(), count, datatype_of(data.scalar_type()), dst, payload_tag(tag), comm_,
                     &op->requests[1]);
    }
    if (rc != MPI_SUCCESS) abandon({op->message, op->data});
    check(rc, "send", "MPI_Isend");
  }
  counter_.add_sent(OpKind::kSend, bytes);
  counter_.add_sent(OpKind::kVerify, sizeof(Header));
  sweep_sends();
  {
    std::lock_guard<std::mutex> lock(sends_mutex_);
    sends_.push_back(op);
  }
  return std::make_shared<SendWork>(this, op);
}

void MpiCommunicator::sweep_sends() {
  std::lock_guard<std::mutex> lock(sends_mutex_);
  for (auto it = sends_.begin(); it != sends_.end();) {
    std::unique_lock<std::mutex> op_lock((*it)->mutex, std::try_to_lock);
    int error = MPI_SUCCESS;
    if (op_lock.owns_lock() && (*it)->test(error)) {
      op_lock.unlock();
      it = sends_.erase(it);
    } else {
      ++it;
    }
  }
}

// ---- receiving

MpiCommunicator::Channel& MpiCommunicator::channel(int src, int tag) {
  std::lock_guard<std::mutex> lock(channels_mutex_);
  auto& ch = channels_[{src, tag}];
  if (!ch) ch.reset(new Channel);
  return *ch;
}

WorkPtr MpiCommunicator::start_recv(at::Tensor tensor, int src, int tag) {
  return post_recv(src, tag, std::move(tensor));
}

WorkPtr MpiCommunicator::start_recv_any(int src, int tag) {
  MESHTRAIN_CHECK(tag >= 0 && tag < (1 << 30), where("recv"), ": tag ", tag, " out of range [0, 2^30)");
  return post_recv(src, tag, at::Tensor());
}

WorkPtr MpiCommunicator::post_recv(int src, int tag, at::Tensor target) {
  counter_.add_call(OpKind::kRecv);
  auto op = std::make_shared<RecvOp>();
  op->tag = tag;
  op->target = std::move(target);
  op->header = at::empty({message_capacity()}, at::kByte);
  Channel& ch = channel(src, tag);
  {
    std::lock_guard<std::mutex> lock(ch.mutex);
    check(MPI_Irecv(op->header.data_ptr(), static_cast<int>(op->header.nbytes()), MPI_BYTE, src, header_tag(tag), comm_,
                    &op->header_request),
          "recv", "MPI_Irecv");
    ch.posted.push_back(op);
  }
  return std::make_shared<RecvWork>(this, op, src);
}

namespace {

// Hands a complete message to its receive: the tensor, or MismatchError when
// irecv's tensor has another dtype or shape.
void deliver(RecvOp& op, const std::string& where, const std::string& from) {
  const at::Tensor& message = op.landing;
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
  op.landing = at::Tensor();
  op.header = at::Tensor();
  op.done = true;
}

}  // namespace

void MpiCommunicator::advance(Channel& ch, int src, int tag) {
  if (!ch.broken.empty()) throw CommError(ch.broken);
  // A malformed header leaves the channel's stream unreadable (the message's
  // other part, if any, is still to come): this receive and every later one fail.
  auto corrupt = [&](RecvOp& op, const char* what) {
    ch.broken = str_cat(where("recv"), ": ", what, " from ", peer_name(src), " (tag ", tag, ")");
    op.error = std::make_exception_ptr(CommError(ch.broken));
    op.done = true;
    abandoned_ = true;  // its other part may never be received
    throw CommError(ch.broken);
  };
  for (auto& op : ch.posted) {
    if (!op->header_done) {
      int flag = 0;
      MPI_Status status;
      check(MPI_Test(&op->header_request, &flag, &status), "recv", "MPI_Test");
      if (!flag) break;  // later headers are later messages: they wait for this one
      op->header_done = true;
      int bytes = 0;
      MPI_Get_count(&status, MPI_BYTE, &bytes);
      const Header& h = *static_cast<const Header*>(op->header.data_ptr());
      const bool sane = bytes >= static_cast<int>(sizeof(Header)) && h.magic == Header().magic && h.ndim >= 0 &&
                        h.ndim <= 8 && supported_dtype(static_cast<at::ScalarType>(h.dtype)) &&
                        h.inline_after >= 0 && h.inline_after <= h.inline_bytes &&
                        h.inline_bytes - h.inline_after == bytes - static_cast<int64_t>(sizeof(Header));
      if (!sane) corrupt(*op, "malformed message header");
      const auto dtype = static_cast<at::ScalarType>(h.dtype);
      const std::vector<int64_t> shape = shape_of(h);
      const at::Tensor& t = op->target;
      const bool direct = t.defined() && t.is_contiguous() && t.scalar_type() == dtype && t.sizes() == at::IntArrayRef(shape);
      op->landing = direct ? t : at::empty(shape, at::TensorOptions().dtype(dtype));
      const int64_t payload = op->landing.nbytes();
      counter_.add_received(OpKind::kVerify, sizeof(Header));
      if (h.inline_bytes > 0) {
        if (h.inline_bytes != payload) corrupt(*op, "inconsistent header");
        char* landing = static_cast<char*>(op->landing.data_ptr());
        const int64_t first = payload - h.inline_after;
        std::memcpy(landing, static_cast<const char*>(op->header.data_ptr()) + sizeof(Header), first);
        if (h.inline_after > 0) {  // the rest of an inline payload larger than MPI's eager size
          check(MPI_Irecv(landing + first, h.inline_after, MPI_BYTE, src, payload_tag(tag), comm_, &op->payload_request),
                "recv", "MPI_Irecv");
        }
      } else if (payload > 0) {
        check(MPI_Irecv(op->landing.data_ptr(), static_cast<int>(op->landing.numel()), datatype_of(dtype), src,
                        payload_tag(tag), comm_, &op->payload_request),
              "recv", "MPI_Irecv");
      }
    }
    if (op->done) continue;
    int flag = 1;
    if (op->payload_request != MPI_REQUEST_NULL) {
      check(MPI_Test(&op->payload_request, &flag, MPI_STATUS_IGNORE), "recv", "MPI_Test");
    }
    if (!flag) continue;
    counter_.add_received(OpKind::kRecv, op->landing.nbytes());
    deliver(*op, where("recv"), peer_name(src));
  }
  while (!ch.posted.empty() && ch.posted.front()->done) ch.posted.pop_front();
}

// ---- destruction

void MpiCommunicator::drain_p2p() {
  // Receives still posted: cancel them, and keep what MPI may yet write into.
  std::vector<MPI_Request> pending;
  std::vector<at::Tensor> buffers;
  for (auto& entry : channels_) {
    std::lock_guard<std::mutex> lock(entry.second->mutex);
    for (auto& op : entry.second->posted) {
      for (MPI_Request* r : {&op->header_request, &op->payload_request}) {
        if (*r == MPI_REQUEST_NULL) continue;
        MPI_Cancel(r);
        pending.push_back(*r);
      }
      buffers.insert(buffers.end(), {op->header, op->landing, op->target});
    }
  }
  // Sends not yet known complete: the peer may still receive them.
  sweep_sends();
  {
    std::lock_guard<std::mutex> lock(sends_mutex_);
    for (auto& op : sends_) buffers.insert(buffers.end(), {op->message, op->data});
  }
  int error = MPI_SUCCESS;
  const bool cancelled = pending.empty() ||
                         poll_all(pending.data(), static_cast<int>(pending.size()),
                                  Clock::now() + std::chrono::milliseconds(100), 0, error);
  if (!cancelled || !sends_.empty()) {
    abandoned_ = true;
    abandon(std::move(buffers));
  }
}

}  // namespace mpi_backend
}  // namespace comm
}  // namespace meshtrain
