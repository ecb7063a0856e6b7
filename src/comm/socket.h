#pragma once
// Small blocking-socket helpers for the store (internal to src/comm).

#include <chrono>
#include <cstdint>
#include <string>

namespace meshtrain {
namespace comm {
namespace net {

using Clock = std::chrono::steady_clock;

// Binds and listens on host:port (port 0: the kernel picks one). Only the given
// address is bound, never all interfaces. Returns the fd; *bound_port gets the port.
// Throws ConfigError naming host and port when the address is taken or invalid.
int listen_on(const std::string& host, int port, int* bound_port);

// Connects to host:port, retrying while nobody listens yet, until `deadline`.
// Throws TimeoutError naming the address when it cannot connect in time.
int connect_to(const std::string& host, int port, Clock::time_point deadline,
               const std::string& what);

// Note [Silent links]
// A host that goes down, or a link that is cut, closes no connection: the
// kernel keeps an idle TCP connection open forever and retransmits unacknowledged
// data for ~15 minutes. Every store connection (both ends) therefore has
// keepalive probes and TCP_USER_TIMEOUT set so that a peer that stops answering
// at the TCP level (the kernel's, not the process's: a stopped or busy process
// still acknowledges) breaks the connection within link_timeout(); the error is
// ETIMEDOUT (link_went_silent()), told apart from a closed connection. A
// one-way cut needs data in flight both ways as well: the store's heartbeats
// (Note [Heartbeats] in store_server.cpp).
std::chrono::seconds link_timeout();  // MESHTRAIN_LINK_TIMEOUT_S, default 8
void watch_link(int fd);
// Unacknowledged data breaks `fd` after `timeout` rather than link_timeout() (the store's heartbeats).
void set_unacknowledged_timeout(int fd, std::chrono::milliseconds timeout);
bool link_went_silent(int error);  // errno after a failed recv/send
// Whether data sent on `fd` waits for an acknowledgement that has not come
// within a retransmission time-out (TCP_INFO): the way to the peer, or back, is lost.
bool link_retransmitting(int fd);
// "the link to <host> went silent: no TCP acknowledgement or keepalive reply for 8 s (...)"
std::string silent_link_reason(const std::string& host, std::chrono::milliseconds after = link_timeout());

// Writes all bytes (MSG_NOSIGNAL: a closed peer gives an error, not SIGPIPE).
// Returns false when the connection is broken.
bool write_all(int fd, const void* data, size_t size);
// Reads exactly `size` bytes. Returns false on EOF or error; throws TimeoutError
// when nothing arrives before `deadline` (Clock::time_point::max() = no limit).
bool read_exact(int fd, void* data, size_t size, Clock::time_point deadline);

// A frame is a little-endian uint32 length followed by that many bytes, at
// most kMaxFrame (store keys and values are addresses and small records; a
// larger length is a stranger's or a corrupt stream, refused before any
// allocation).
constexpr uint32_t kMaxFrame = 64u << 20;
std::string frame_of(const std::string& payload);
bool write_frame(int fd, const std::string& payload);
// False on EOF or error, or a length over kMaxFrame.
bool read_frame(int fd, std::string* payload, Clock::time_point deadline);

// Binary field codec for frames.
class Writer {
 public:
  Writer& u8(uint8_t v);
  Writer& i64(int64_t v);
  Writer& str(const std::string& s);
  const std::string& bytes() const { return buf_; }

 private:
  std::string buf_;
};

class Reader {
 public:
  explicit Reader(const std::string& buf) : buf_(buf) {}
  uint8_t u8();
  int64_t i64();
  std::string str();

 private:
  void need(size_t n) const;
  const std::string& buf_;
  size_t pos_ = 0;
};

// True when `host` is a loopback name or address (127.x, ::1, localhost).
bool is_loopback(const std::string& host);
// The local address this machine uses to reach `host` (a UDP connect, no
// packet sent); "127.0.0.1" when host is loopback.
std::string local_address_towards(const std::string& host);

}  // namespace net
}  // namespace comm
}  // namespace meshtrain
