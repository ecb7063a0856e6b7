#pragma once
// tcp::Links' state per connection and the sizes its reading and writing
// share (links.cpp: connecting, sending, waiting; links_read.cpp: reading).
// Private to src/comm/tcp.

#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <string>
#include <vector>

#include "links.h"

namespace meshtrain {
namespace comm {
namespace tcp {

constexpr size_t kStage = 64 << 10;  // per-peer read buffer; larger payloads are read into their buffer directly
// A message of at least this many bytes with no receive posted yet stays in
// the socket until one is, or until a thread waiting here would sleep (Note
// [Large messages wait in the socket]).
constexpr uint64_t kHoldBytes = kStage;
// So a held message always needs bytes still in the socket: what was staged
// with its header is less than its body, and its release is read on POLLIN.
static_assert(kHoldBytes >= kStage, "a held message must not fit in the stage");
// A header announcing more than this is a corrupt stream, refused before any allocation.
constexpr uint64_t kMaxMessage = uint64_t(1) << 40;

struct Links::Peer {
  int rank = -1;
  int fd = -1;
  std::string broken;  // why the connection broke; "" while it works
  // Why writing to the peer failed ("" while it works). Reads go on until the
  // stream ends: what the peer sent before it closed (the header that says
  // why it stopped, Note [Verification beside the data]) is still read.
  std::string send_broken;
  // Outgoing: queued sends, the front one written up to out_offset bytes of (Wire + payload).
  std::deque<RequestPtr> sends;
  size_t out_offset = 0;
  // Incoming: the message being read, into its posted receive or a spare buffer.
  Wire in_wire{};
  size_t in_wire_got = 0;
  bool in_body = false;
  RequestPtr in_target;
  std::vector<uint8_t> in_spare;
  bool in_discard = false;  // the message's receive was cancelled: read it and drop it
  bool held = false;  // in_wire is a large message's header whose receive is not posted: not read further
  uint8_t* in_dst = nullptr;
  size_t in_got = 0;
  std::vector<uint8_t> stage;  // bytes read from the socket, not yet consumed
  size_t stage_pos = 0, stage_len = 0;
  std::map<uint64_t, std::deque<RequestPtr>> posted;               // receives by slot, oldest first
  std::map<uint64_t, std::deque<std::vector<uint8_t>>> early;      // messages before their receive
};

}  // namespace tcp
}  // namespace comm
}  // namespace meshtrain
