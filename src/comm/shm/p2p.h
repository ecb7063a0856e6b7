#pragma once
// Point-to-point messages over shared memory: the state each side keeps.
// See Note [Shared-memory rings] in p2p.cpp.

#include <ATen/core/Tensor.h>

#include <atomic>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>

#include "../header.h"
#include "layout.h"

namespace meshtrain {
namespace comm {
namespace shm_backend {

// What precedes every payload on a ring.
struct Frame {
  uint32_t magic = 0x6d736731;  // "msg1"
  int32_t tag = 0;
  int64_t payload = 0;  // bytes
  Header desc;          // dtype and shape
};
constexpr size_t kFrameBytes = round_up(sizeof(Frame), kLine);

// A message being written into a ring (by isend's caller, then by the sender thread).
struct SendOp {
  int dst = -1;
  at::Tensor data;  // contiguous; kept alive until written
  Frame frame;
  uint64_t total = 0;    // frame + payload padded to a cache line
  uint64_t written = 0;  // bytes of that already in the ring
  bool done = false;     // under the communicator's sender_mutex_
  std::exception_ptr error;
};

// A posted receive.
struct RecvOp {
  int tag = 0;
  at::Tensor target;  // irecv's tensor; undefined for irecv_any
  std::atomic<bool> done{false};
  std::exception_ptr error;
  at::Tensor result;
};

// The message being read from a ring.
struct Incoming {
  bool active = false;
  Frame frame;
  std::shared_ptr<RecvOp> op;  // the receive it completes, or null: kept until one is posted
  at::Tensor landing;          // where the payload goes
  uint64_t received = 0;       // bytes of payload + padding consumed
};

// The receiving side of one (src -> this rank) ring.
struct Inbox {
  std::mutex mutex;
  std::deque<std::shared_ptr<RecvOp>> posted;          // waiting receives, in post order
  std::deque<std::pair<int, at::Tensor>> arrived;      // (tag, tensor) no receive was posted for yet
  Incoming current;
  uint64_t seen_head = 0;  // the ring's head when it was last read: wait for it to move
  bool populated = false;  // the ring's pages are mapped in this process
};

}  // namespace shm_backend
}  // namespace comm
}  // namespace meshtrain
