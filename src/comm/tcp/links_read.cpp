// tcp::Links, the reading side: bytes from a socket into the messages they
// carry, each matched to its posted receive (Note [Links: progress on the
// waiting thread] in links.h).

#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "../socket.h"
#include "links.h"
#include "links_peer.h"
#include "meshtrain/util.h"

namespace meshtrain {
namespace comm {
namespace tcp {

void Links::read_available(Peer& p) {
  if (p.stage.empty()) p.stage.resize(kStage);
  consume_stage(p);  // bytes read before a message was held
  while (p.broken.empty() && !p.held) {
    uint8_t* dst = p.stage.data();
    size_t want = kStage;
    const bool direct = p.in_body && p.in_dst && p.in_wire.bytes - p.in_got >= kStage;
    if (direct) dst = p.in_dst + p.in_got, want = p.in_wire.bytes - p.in_got;  // straight into the buffer
    const ssize_t k = ::recv(p.fd, dst, want, MSG_DONTWAIT);
    if (k < 0 && errno == EINTR) continue;
    if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
    if (k <= 0) {
      const int error = k == 0 ? 0 : errno;
      break_peer(p, k == 0 ? std::string("the peer closed the connection")
                    : net::link_went_silent(error) ? net::silent_link_reason(str_cat("rank ", p.rank))
                                                   : str_cat("receive failed: ", std::strerror(error)));
      return;
    }
    const bool drained = static_cast<size_t>(k) < want;  // the socket had no more
    if (direct) {
      p.in_got += static_cast<size_t>(k);
      if (p.in_got == p.in_wire.bytes) finish_message(p);
    } else {
      p.stage_pos = 0;
      p.stage_len = static_cast<size_t>(k);
      consume_stage(p);
    }
    if (drained) return;
  }
}

// Hands the staged bytes to the headers and messages they belong to, until
// they run out or a message is held (the rest stays staged for its release).
void Links::consume_stage(Peer& p) {
  while (p.stage_pos < p.stage_len && p.broken.empty() && !p.held) {
    const uint8_t* src = p.stage.data() + p.stage_pos;
    const size_t avail = p.stage_len - p.stage_pos;
    if (!p.in_body) {
      const size_t take = std::min(sizeof(Wire) - p.in_wire_got, avail);
      std::memcpy(reinterpret_cast<uint8_t*>(&p.in_wire) + p.in_wire_got, src, take);
      p.in_wire_got += take;
      p.stage_pos += take;
      if (p.in_wire_got == sizeof(Wire)) hold_or_start(p);
    } else {
      const size_t take = std::min<size_t>(p.in_wire.bytes - p.in_got, avail);
      if (p.in_dst) std::memcpy(p.in_dst + p.in_got, src, take);  // none: a message dropped
      p.in_got += take;
      p.stage_pos += take;
      if (p.in_got == p.in_wire.bytes) finish_message(p);
    }
  }
}

// Note [Large messages wait in the socket]
// Sends are eager, so a rank that reads the end of one message may find the
// next one behind it before its receive is posted: the root of a broadcast
// loop sends call i+1 while its peer still drains call i. Read then, a large
// message would go into a spare buffer, zeroed, faulted in, and copied again
// when its receive comes (a broadcast loop of 64 MiB on 2 ranks: a sixth of
// the receiver's time in memset and memcpy, and 1.6 to 1.8x the time per
// call of reading in place, for 16 and 64 MiB). Instead its header
// is kept and the rest stays in the socket, where the sender's window holds
// it back, until its receive is posted and it is read straight into its
// buffer. So that no wait can depend on it, it is read as before (into a
// spare) when a receive from that peer is posted for another slot, before
// or after it arrives (that message comes behind it), or a thread waiting on
// these links would sleep: a wait that finds nothing to read may be waiting
// on something that needs this message gone (a send to the peer, the peer's
// next step).
void Links::hold_or_start(Peer& p) {
  // Any receive posted on this peer is this message's or one behind it: read on.
  if (p.posted.empty() && p.in_wire.bytes >= kHoldBytes && p.in_wire.bytes <= kMaxMessage) {
    p.held = true;
    return;
  }
  start_message(p);
}

void Links::release(Peer& p) {
  p.held = false;
  start_message(p);
}

void Links::release_held() {
  for (auto& p : peers_)
    if (p && p->held && p->broken.empty()) release(*p);
}

void Links::start_message(Peer& p) {
  p.in_wire_got = 0;
  p.in_body = true;
  p.in_got = 0;
  p.in_discard = false;
  if (p.in_wire.bytes > kMaxMessage) {
    break_peer(p, str_cat("a message header announced ", p.in_wire.bytes, " bytes: a corrupt stream"));
    return;
  }
  auto it = p.posted.find(p.in_wire.slot);
  if (it != p.posted.end()) {
    RequestPtr target = std::move(it->second.front());
    it->second.pop_front();
    if (it->second.empty()) p.posted.erase(it);
    if (p.in_wire.bytes > target->size) {  // read past, to keep the stream whole
      too_large(*target, p.in_wire.bytes);
      p.in_discard = true;
    } else {
      p.in_target = std::move(target);
      p.in_dst = p.in_target->data;
    }
  } else {
    early_bytes_ += p.in_wire.bytes;
    p.in_spare.assign(p.in_wire.bytes, 0);
    p.in_dst = p.in_spare.data();
  }
  if (p.in_wire.bytes == 0) finish_message(p);
}

void Links::finish_message(Peer& p) {
  p.in_body = false;
  p.in_dst = nullptr;
  if (p.in_discard) {  // its receive was cancelled, or too small
    p.in_discard = false;
    return;
  }
  if (!p.in_target) {  // a receive may have been posted while it arrived
    auto it = p.posted.find(p.in_wire.slot);
    if (it != p.posted.end()) {
      p.in_target = std::move(it->second.front());
      it->second.pop_front();
      if (it->second.empty()) p.posted.erase(it);
      if (p.in_spare.size() > p.in_target->size) {
        too_large(*p.in_target, p.in_spare.size());
        p.in_target.reset();
        p.in_spare = {};
        return;
      }
      std::memcpy(p.in_target->data, p.in_spare.data(), p.in_spare.size());
    }
  }
  if (p.in_target) {
    p.in_target->received = p.in_wire.bytes;
    p.in_target->done = true;
    p.in_target.reset();
    p.in_spare = {};
  } else {
    p.early[p.in_wire.slot].push_back(std::move(p.in_spare));
    p.in_spare = {};
  }
}

void Links::too_large(Request& r, size_t bytes) {
  r.too_large = true;
  r.failed = true;
  r.received = bytes;
  rounds_.notify_all();
}

}  // namespace tcp
}  // namespace comm
}  // namespace meshtrain
