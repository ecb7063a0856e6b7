#include "socket.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <linux/sockios.h>
#include <poll.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "meshtrain/comm.h"
#include "meshtrain/util.h"
#include "tuning_env.h"

namespace meshtrain {
namespace comm {
namespace net {

namespace {

struct AddrInfo {
  addrinfo* head = nullptr;
  ~AddrInfo() {
    if (head) freeaddrinfo(head);
  }
};

// Resolves host:port; throws ConfigError naming the host when it does not resolve.
void resolve(const std::string& host, int port, bool passive, AddrInfo* out) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  if (passive) hints.ai_flags = AI_PASSIVE;
  const std::string service = std::to_string(port);
  const int rc = getaddrinfo(host.c_str(), service.c_str(), &hints, &out->head);
  MESHTRAIN_CHECK(rc == 0, "cannot resolve host '", host, "': ", gai_strerror(rc),
                  "; give an IP address or a resolvable host name");
}

int poll_ms(Clock::time_point deadline) {
  if (deadline == Clock::time_point::max()) return -1;
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  return left.count() < 0 ? 0 : static_cast<int>(std::min<int64_t>(left.count(), 1 << 30));
}

}  // namespace

int listen_on(const std::string& host, int port, int* bound_port) {
  MESHTRAIN_CHECK(port >= 0 && port <= 65535, "port ", port, " is out of range [0, 65535]");
  AddrInfo ai;
  resolve(host, port, /*passive=*/true, &ai);
  std::string last_error = "no address";
  for (addrinfo* a = ai.head; a; a = a->ai_next) {
    const int fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    int on = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &on, sizeof on);
    if (bind(fd, a->ai_addr, a->ai_addrlen) == 0 && listen(fd, 1024) == 0) {
      sockaddr_storage ss{};
      socklen_t len = sizeof ss;
      getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len);
      *bound_port = ss.ss_family == AF_INET6
                        ? ntohs(reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port)
                        : ntohs(reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
      return fd;
    }
    last_error = std::strerror(errno);
    const int err = errno;
    ::close(fd);
    if (err == EADDRINUSE) {
      throw ConfigError(str_cat("port ", port, " on ", host,
                                " is already in use (MASTER_PORT); pick another port, or let "
                                "meshrun choose one with --master-port 0"));
    }
  }
  throw ConfigError(str_cat("cannot listen on ", host, ":", port, ": ", last_error,
                            " (MASTER_ADDR must be an address of this machine)"));
}

int connect_to(const std::string& host, int port, Clock::time_point deadline,
               const std::string& what) {
  std::string last_error;
  auto backoff = std::chrono::milliseconds(10);
  while (true) {
    AddrInfo ai;
    resolve(host, port, /*passive=*/false, &ai);
    for (addrinfo* a = ai.head; a; a = a->ai_next) {
      const int fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
      if (fd < 0) continue;
      if (::connect(fd, a->ai_addr, a->ai_addrlen) == 0) {
        int on = 1;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &on, sizeof on);
        watch_link(fd);
        return fd;
      }
      last_error = std::strerror(errno);
      ::close(fd);
    }
    if (Clock::now() + backoff > deadline) break;
    std::this_thread::sleep_for(backoff);
    backoff = std::min(backoff * 2, std::chrono::milliseconds(200));
  }
  throw TimeoutError(str_cat("could not connect to ", what, " at ", host, ":", port,
                             " before the timeout (last error: ", last_error,
                             "); check MASTER_ADDR/MASTER_PORT and that rank 0 or the "
                             "launcher is running"));
}

std::chrono::seconds link_timeout() {
  static const std::chrono::seconds value = link_timeout_from_env();  // once per process
  return value;
}

void set_unacknowledged_timeout(int fd, std::chrono::milliseconds timeout) {
  const unsigned ms = static_cast<unsigned>(timeout.count());
  setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &ms, sizeof ms);
}

void watch_link(int fd) {
  const int total = static_cast<int>(link_timeout().count());
  const int on = 1, idle = std::max(1, total / 4), interval = std::max(1, total / 8);
  const int probes = std::max(1, (total - idle) / interval);
  setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &on, sizeof on);
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof idle);
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &interval, sizeof interval);
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &probes, sizeof probes);
  set_unacknowledged_timeout(fd, link_timeout());
}

bool link_retransmitting(int fd) {
  tcp_info info{};
  socklen_t len = sizeof info;
  if (getsockopt(fd, IPPROTO_TCP, TCP_INFO, &info, &len) != 0) return false;
  // Sent and unacknowledged past a retransmission time-out; or never sent,
  // because the way out drops it (a local queue that drops everything puts TCP
  // in probing, not retransmitting), with a probe unanswered.
  int queued = 0;  // bytes sent and not acknowledged, or not yet sent
  const bool waiting = ::ioctl(fd, SIOCOUTQ, &queued) == 0 && queued > 0;
  return waiting && (info.tcpi_retransmits > 0 || info.tcpi_probes > 0);
}

bool link_went_silent(int error) { return error == ETIMEDOUT || error == EHOSTUNREACH || error == ENETUNREACH; }

std::string silent_link_reason(const std::string& host, std::chrono::milliseconds after) {
  return str_cat("the link to ", host, " went silent: no TCP acknowledgement or keepalive reply for ",
                 std::chrono::duration_cast<std::chrono::seconds>(after).count(), " s; that host is down, or the network to it is cut "
                 "(MESHTRAIN_LINK_TIMEOUT_S sets the wait)");
}

bool write_all(int fd, const void* data, size_t size) {
  const char* p = static_cast<const char*>(data);
  while (size > 0) {
    const ssize_t n = ::send(fd, p, size, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    p += n;
    size -= static_cast<size_t>(n);
  }
  return true;
}

bool read_exact(int fd, void* data, size_t size, Clock::time_point deadline) {
  char* p = static_cast<char*>(data);
  while (size > 0) {
    pollfd pfd{fd, POLLIN, 0};
    const int rc = ::poll(&pfd, 1, poll_ms(deadline));
    if (rc < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    if (rc == 0) throw TimeoutError("timed out waiting for a reply from the store");
    const ssize_t n = ::recv(fd, p, size, 0);
    if (n == 0) return false;
    if (n < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      return false;
    }
    p += n;
    size -= static_cast<size_t>(n);
  }
  return true;
}

std::string frame_of(const std::string& payload) {
  const uint32_t len = static_cast<uint32_t>(payload.size());
  return std::string(reinterpret_cast<const char*>(&len), 4) + payload;
}

bool write_frame(int fd, const std::string& payload) {
  const std::string frame = frame_of(payload);
  return write_all(fd, frame.data(), frame.size());
}

bool read_frame(int fd, std::string* payload, Clock::time_point deadline) {
  uint32_t len = 0;
  if (!read_exact(fd, &len, 4, deadline) || len > kMaxFrame) return false;
  payload->resize(len);
  return len == 0 || read_exact(fd, &(*payload)[0], len, deadline);
}

Writer& Writer::u8(uint8_t v) {
  buf_.push_back(static_cast<char>(v));
  return *this;
}

Writer& Writer::i64(int64_t v) {
  buf_.append(reinterpret_cast<const char*>(&v), 8);
  return *this;
}

Writer& Writer::str(const std::string& s) {
  i64(static_cast<int64_t>(s.size()));
  buf_ += s;
  return *this;
}

void Reader::need(size_t n) const {
  if (pos_ + n > buf_.size()) throw CommError("malformed store message (truncated)");
}

uint8_t Reader::u8() {
  need(1);
  return static_cast<uint8_t>(buf_[pos_++]);
}

int64_t Reader::i64() {
  need(8);
  int64_t v;
  std::memcpy(&v, buf_.data() + pos_, 8);
  pos_ += 8;
  return v;
}

std::string Reader::str() {
  const int64_t n = i64();
  if (n < 0) throw CommError("malformed store message (negative length)");
  need(static_cast<size_t>(n));
  std::string s = buf_.substr(pos_, static_cast<size_t>(n));
  pos_ += static_cast<size_t>(n);
  return s;
}

bool is_loopback(const std::string& host) {
  if (host == "localhost" || host == "::1") return true;
  return host.rfind("127.", 0) == 0;
}

std::string local_address_towards(const std::string& host) {
  if (is_loopback(host)) return "127.0.0.1";
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* head = nullptr;
  if (getaddrinfo(host.c_str(), "9", &hints, &head) != 0 || !head) return host;
  std::string result = host;
  const int fd = socket(head->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd >= 0 && ::connect(fd, head->ai_addr, head->ai_addrlen) == 0) {
    sockaddr_storage ss{};
    socklen_t len = sizeof ss;
    if (getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len) == 0) {
      char buf[INET6_ADDRSTRLEN] = {0};
      const void* addr = ss.ss_family == AF_INET6
                             ? static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(&ss)->sin6_addr)
                             : static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(&ss)->sin_addr);
      if (inet_ntop(ss.ss_family, addr, buf, sizeof buf)) result = buf;
    }
  }
  if (fd >= 0) ::close(fd);
  freeaddrinfo(head);
  return result;
}

}  // namespace net
}  // namespace comm
}  // namespace meshtrain
