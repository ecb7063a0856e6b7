#pragma once
// Transport: what the message algorithms (src/comm/tcp/: ring, direct, chain,
// doubling; TcpCommunicator's post_send, post_recv and wait) ask of a
// wire. Byte messages between the members of one communicator, each addressed
// by (peer, slot) and matched to a receive posted for the same (peer, slot),
// in order when several share one; sends may leave before their receive is
// posted (eager); a wait progresses whatever the transport needs and applies
// a timeout. Meshtrain's TCP links implement it (tcp::Links); libgloo's
// transport did until it was measured slower (docs/comm.md, "Transports");
// another wire (MPI point to point, RDMA) would implement these six calls and
// get every algorithm above them, their traffic counts and error paths.
//
// Buffer ownership: a posted request's buffer belongs to the transport until
// the request completed (wait() returned kDone, or a failure) or was
// withdrawn (cancel()); Posted withdraws whatever is dropped unfinished.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace meshtrain {
namespace comm {

// A posted send or receive. Filled in by the transport; read after wait() returns kDone.
struct Request {
  int peer = -1;
  uint64_t slot = 0;
  bool is_recv = false;
  uint8_t* data = nullptr;
  size_t size = 0;      // send: bytes to send; recv: the buffer's capacity
  size_t received = 0;  // recv: bytes the message carried (<= size); kTooLarge: what it carried
  bool done = false;
  bool failed = false;  // the connection broke or stopped sending (broken_reason says why), cancelled, or too_large
  bool too_large = false;  // recv: the message did not fit (it was read and dropped; the link works)
  std::vector<uint8_t> owned;  // a cancelled send's unsent rest (Transport::cancel)
};
using RequestPtr = std::shared_ptr<Request>;

// kTooLarge: the message matched to a receive was larger than its buffer
// (ranks that disagree on a size); it was read and dropped, the link works on.
enum class WaitResult { kDone, kBroken, kTimeout, kAborted, kTooLarge };

class Transport {
 public:
  virtual ~Transport() = default;
  // `hold`: the message may wait for the next send to `peer` that is not held
  // and leave with it (one system call for both), or for the next wait.
  virtual RequestPtr send(int peer, uint64_t slot, const void* data, size_t bytes, bool hold = false) = 0;
  virtual RequestPtr recv(int peer, uint64_t slot, void* data, size_t capacity) = 0;
  // Progresses the transport until `r` completes, its connection breaks,
  // `timeout` passes with `r` incomplete, or abort() is called.
  virtual WaitResult wait(Request& r, std::chrono::milliseconds timeout) = 0;
  // Thread-safe: every wait, current and later, returns kAborted.
  virtual void abort() = 0;
  // The caller is about to free `r`'s buffer without waiting for it (an error
  // path): a posted receive is withdrawn, a send not yet begun dropped, one
  // partly sent finished from a copy of its rest (the peer expects those bytes).
  virtual void cancel(Request& r) = 0;
  // Why the connection to `peer` broke ("" when it has not).
  virtual std::string broken_reason(int peer) const = 0;
};

// A posted request that is withdrawn (Transport::cancel) when dropped before it
// completed: the owner of its buffer may free the buffer after an error
// without the transport writing into it or reading from it later.
class Posted {
 public:
  Posted() = default;
  Posted(Transport* transport, RequestPtr r) : transport_(transport), r_(std::move(r)) {}
  Posted(Posted&& o) noexcept : transport_(o.transport_), r_(std::move(o.r_)) {}
  Posted& operator=(Posted&& o) noexcept {
    withdraw();
    transport_ = o.transport_;
    r_ = std::move(o.r_);
    return *this;
  }
  ~Posted() { withdraw(); }
  Request* get() const { return r_.get(); }
  Request& operator*() const { return *r_; }
  Request* operator->() const { return r_.get(); }
  explicit operator bool() const { return r_ != nullptr; }
  void reset() { r_.reset(); }  // completed: nothing to withdraw

 private:
  void withdraw() noexcept {
    try {
      if (r_ && transport_) transport_->cancel(*r_);
    } catch (...) {
    }
    r_.reset();
  }
  Transport* transport_ = nullptr;
  RequestPtr r_;
};

}  // namespace comm
}  // namespace meshtrain
