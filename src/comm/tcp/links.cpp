// tcp::Links: see Note [Links: progress on the waiting thread] in links.h.

#include "links.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sched.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "../socket.h"
#include "links_peer.h"
#include "meshtrain/comm.h"
#include "meshtrain/util.h"

namespace meshtrain {
namespace comm {
namespace tcp {

namespace {

using Clock = std::chrono::steady_clock;

constexpr uint32_t kHelloMagic = 0x6d6c6e6b;  // "mlnk"

struct Hello {
  uint32_t magic;
  int32_t rank;
};

int ms_until(Clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return static_cast<int>(std::clamp<int64_t>(left + 1, 0, 1 << 30));
}

// No TCP_USER_TIMEOUT here (unlike the store's links, Note [Silent links]):
// a receiver that computes for longer than it while an eager send waits
// behind its full window would have the kernel abort a healthy connection
// (Linux applies the user timeout to zero-window probing). Dead and
// unreachable hosts are named through the store's links and heartbeats, which
// abort these waits, and the communicator's timeout bounds every wait.
void configure(int fd) {
  int one = 1, none = 0;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  ::setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &none, sizeof(none));  // net::connect_to set one
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK);
}

// Whether the connection's two ends have one address: both ends on this host.
bool stays_on_host(int fd) {
  sockaddr_storage mine{}, theirs{};
  socklen_t a = sizeof mine, b = sizeof theirs;
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&mine), &a) != 0 ||
      ::getpeername(fd, reinterpret_cast<sockaddr*>(&theirs), &b) != 0 || mine.ss_family != theirs.ss_family) {
    return false;
  }
  if (mine.ss_family == AF_INET) {
    return reinterpret_cast<sockaddr_in&>(mine).sin_addr.s_addr == reinterpret_cast<sockaddr_in&>(theirs).sin_addr.s_addr;
  }
  if (mine.ss_family == AF_INET6) {
    return std::memcmp(&reinterpret_cast<sockaddr_in6&>(mine).sin6_addr, &reinterpret_cast<sockaddr_in6&>(theirs).sin6_addr,
                       sizeof(in6_addr)) == 0;
  }
  return false;
}

constexpr size_t kBatch = 16;  // queued sends written by one sendmsg

// Marks the polling thread's round over, whichever way it ends (an exception
// included), so that the other waiters do not sleep on a poller that left.
struct PollingRound {
  PollingRound(bool& polling, std::condition_variable& rounds) : polling(polling), rounds(rounds) { polling = true; }
  ~PollingRound() {
    polling = false;
    rounds.notify_all();
  }
  bool& polling;
  std::condition_variable& rounds;
};

// Accepts the next connection before `deadline`; -1 when none came.
int accept_before(int listen_fd, Clock::time_point deadline) {
  for (;;) {
    pollfd pfd{listen_fd, POLLIN, 0};
    const int rc = ::poll(&pfd, 1, ms_until(deadline));
    if (rc < 0 && errno == EINTR) continue;
    if (rc <= 0) return -1;
    const int fd = ::accept(listen_fd, nullptr, nullptr);
    if (fd >= 0 || (errno != EINTR && errno != EAGAIN && errno != ECONNABORTED)) return fd;
  }
}

}  // namespace

Links::Links(Store& store, int rank, int size, const std::string& bind_host, std::chrono::milliseconds timeout,
             const std::string& label)
    : rank_(rank), size_(size), peers_(size) {
  for (int p = 0; p < size; ++p) {
    if (p == rank) continue;
    peers_[p] = std::make_unique<Peer>();
    peers_[p]->rank = p;
  }
  wake_fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  MESHTRAIN_CHECK(wake_fd_ >= 0, "communicator '", label, "': eventfd failed: ", std::strerror(errno));
  try {
    connect_mesh(store, bind_host, timeout, label);
  } catch (...) {
    for (auto& p : peers_)
      if (p && p->fd >= 0) ::close(p->fd);
    ::close(wake_fd_);
    throw;
  }
}

int Links::set_local_buffer(int64_t bytes) {
  if (bytes <= 0) return 0;
  // The kernel doubles what it is given (half is its bookkeeping) and caps it
  // at net.core.wmem_max (twice that once doubled).
  const int half = static_cast<int>(std::min<int64_t>(bytes / 2, 1 << 30));
  int bounded = 0;
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto& p : peers_) {
    if (!p || !stays_on_host(p->fd)) continue;
    if (::setsockopt(p->fd, SOL_SOCKET, SO_SNDBUF, &half, sizeof half) == 0) ++bounded;
  }
  return bounded;
}

Links::~Links() {
  for (auto& p : peers_)
    if (p && p->fd >= 0) ::close(p->fd);
  if (wake_fd_ >= 0) ::close(wake_fd_);
}

// The higher rank of each pair connects and says who it is; the lower accepts.
// Connections complete in the kernel's backlog, so every rank connects first
// and accepts after, without waiting for one another in turn.
void Links::connect_mesh(Store& store, const std::string& bind_host, std::chrono::milliseconds timeout,
                         const std::string& label) {
  const auto deadline = Clock::now() + timeout;
  int port = 0;
  const int listen_fd = net::listen_on(bind_host, 0, &port);
  store.set("links/" + std::to_string(rank_), bind_host + " " + std::to_string(port));
  try {
    for (int p = 0; p < rank_; ++p) {
      const std::string address = store.get("links/" + std::to_string(p));
      const auto space = address.rfind(' ');
      const std::string host = address.substr(0, space);
      const int peer_port = std::stoi(address.substr(space + 1));
      const int fd = net::connect_to(host, peer_port, deadline,
                                     str_cat("communicator '", label, "': rank ", p, "'s link at ", address));
      peers_[p]->fd = fd;
      const Hello hello{kHelloMagic, rank_};
      MESHTRAIN_CHECK(net::write_all(fd, &hello, sizeof(hello)), "communicator '", label,
                      "': the link to rank ", p, " closed while connecting");
    }
    for (int expected = size_ - 1 - rank_; expected > 0;) {
      const int fd = accept_before(listen_fd, deadline);
      if (fd < 0) {
        throw TimeoutError(str_cat("communicator '", label, "' (rank ", rank_, " of ", size_, "): ", expected,
                                   " higher rank(s) did not connect within ", timeout.count(), " ms"));
      }
      Hello hello{};
      bool read = false;
      try {  // a connection that says nothing is not one of ours: a short deadline of its own
        read = net::read_exact(fd, &hello, sizeof(hello), std::min(deadline, Clock::now() + std::chrono::seconds(2)));
      } catch (const TimeoutError&) {
      }
      if (!read || hello.magic != kHelloMagic || hello.rank <= rank_ || hello.rank >= size_ ||
          peers_[hello.rank]->fd >= 0) {
        ::close(fd);  // not one of ours: keep waiting for the ranks
        continue;
      }
      peers_[hello.rank]->fd = fd;
      --expected;
    }
  } catch (...) {
    ::close(listen_fd);
    throw;
  }
  ::close(listen_fd);
  for (auto& p : peers_)
    if (p) configure(p->fd);
}

Links::Peer& Links::peer_at(int peer) const {
  MESHTRAIN_CHECK(peer >= 0 && peer < size_ && peers_[peer], "tcp::Links of rank ", rank_, " of ", size_,
                  ": no link to rank ", peer, " (a rank has no link to itself)");
  return *peers_[peer];
}

RequestPtr Links::send(int peer, uint64_t slot, const void* data, size_t bytes, bool hold) {
  auto r = std::make_shared<Request>();
  r->peer = peer;
  r->slot = slot;
  r->data = static_cast<uint8_t*>(const_cast<void*>(data));
  r->size = bytes;
  std::lock_guard<std::mutex> lock(mutex_);
  Peer& p = peer_at(peer);
  if (!p.broken.empty() || !p.send_broken.empty()) {
    r->failed = true;
    return r;
  }
  p.sends.push_back(r);
  if (!hold) write_pending(p);
  if (!r->done && polling_) wake_poller();  // the poller adds this socket's POLLOUT
  return r;
}

RequestPtr Links::recv(int peer, uint64_t slot, void* data, size_t capacity) {
  auto r = std::make_shared<Request>();
  r->peer = peer;
  r->slot = slot;
  r->is_recv = true;
  r->data = static_cast<uint8_t*>(data);
  r->size = capacity;
  std::lock_guard<std::mutex> lock(mutex_);
  Peer& p = peer_at(peer);
  auto e = p.early.find(slot);
  if (e != p.early.end()) {  // it arrived already
    std::vector<uint8_t> message = std::move(e->second.front());
    e->second.pop_front();
    if (e->second.empty()) p.early.erase(e);
    if (message.size() > capacity) {
      too_large(*r, message.size());
      return r;
    }
    std::memcpy(r->data, message.data(), message.size());
    r->received = message.size();
    r->done = true;
    return r;
  }
  if (!p.broken.empty()) {
    r->failed = true;
    return r;
  }
  p.posted[slot].push_back(r);
  // A held message goes on now: into this buffer when it is this slot's, or
  // into a spare one, since this receive's message comes behind it.
  if (p.held) release(p);
  return r;
}

// Every queued send to the peer leaves in one sendmsg (up to kBatch of them):
// a collective's held header and its first data (Note [Verification beside
// the data]) cost the kernel one pass through TCP, and the receiver one read.
void Links::write_pending(Peer& p) {
  while (!p.sends.empty() && p.broken.empty()) {
    const size_t count = std::min(p.sends.size(), kBatch);
    Wire wires[kBatch];
    iovec iov[2 * kBatch];
    int n = 0;
    for (size_t i = 0; i < count; ++i) {
      Request& r = *p.sends[i];
      wires[i] = Wire{r.slot, r.size};
      size_t skip = i == 0 ? p.out_offset : 0;  // only the front can be partly written
      if (skip < sizeof(Wire)) {
        iov[n++] = {reinterpret_cast<uint8_t*>(&wires[i]) + skip, sizeof(Wire) - skip};
        skip = 0;
      } else {
        skip -= sizeof(Wire);
      }
      if (r.size > skip) iov[n++] = {r.data + skip, r.size - skip};
    }
    msghdr m{};
    m.msg_iov = iov;
    m.msg_iovlen = n;
    const ssize_t k = ::sendmsg(p.fd, &m, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (k < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return;
      const int error = errno;
      if (net::link_went_silent(error)) {
        break_peer(p, net::silent_link_reason(str_cat("rank ", p.rank)));
      } else {
        break_sends(p, str_cat("send failed: ", std::strerror(error)));
      }
      return;
    }
    size_t written = static_cast<size_t>(k);
    for (size_t i = 0; i < count; ++i) {
      Request& r = *p.sends.front();
      const size_t left = sizeof(Wire) + r.size - p.out_offset;
      if (written < left) {  // the socket is full
        p.out_offset += written;
        return;
      }
      written -= left;
      r.done = true;
      p.sends.pop_front();
      p.out_offset = 0;
    }
  }
}

void Links::fail_sends(Peer& p) {
  for (auto& r : p.sends) r->failed = true;
  p.sends.clear();
  p.out_offset = 0;
}

void Links::break_sends(Peer& p, const std::string& why) {
  if (!p.send_broken.empty()) return;
  p.send_broken = why;
  fail_sends(p);
  if (p.fd >= 0) ::shutdown(p.fd, SHUT_WR);  // the peer learns at once (a half-written message ends there)
  rounds_.notify_all();
}

void Links::break_peer(Peer& p, const std::string& why) {
  if (!p.broken.empty()) return;
  p.broken = why;
  fail_sends(p);
  for (auto& kv : p.posted)
    for (auto& r : kv.second) r->failed = true;
  p.posted.clear();
  if (p.in_target) p.in_target->failed = true;
  p.in_target.reset();
  p.in_body = false;
  // The peer learns at once (its reads end), and every waiter here re-checks.
  if (p.fd >= 0) ::shutdown(p.fd, SHUT_RDWR);
  wake_poller();
  rounds_.notify_all();
}

void Links::cancel(Request& r) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (r.done || r.failed) return;
  Peer& p = peer_at(r.peer);
  r.failed = true;  // whoever still holds it sees a failure, never data
  if (r.is_recv) {
    if (p.in_target.get() == &r) {  // arriving now: the rest goes nowhere
      p.in_dst = nullptr;
      p.in_discard = true;
      p.in_target.reset();
      return;
    }
    auto it = p.posted.find(r.slot);
    if (it == p.posted.end()) return;
    auto& queue = it->second;
    queue.erase(std::remove_if(queue.begin(), queue.end(), [&](const RequestPtr& q) { return q.get() == &r; }),
                queue.end());
    if (queue.empty()) p.posted.erase(it);
    return;
  }
  for (auto it = p.sends.begin(); it != p.sends.end(); ++it) {
    if (it->get() != &r) continue;
    if (it == p.sends.begin() && p.out_offset > 0) {
      // Partly written: the peer expects the rest, so the rest is sent from a copy.
      auto copy = std::make_shared<Request>(r);
      copy->owned.assign(r.data, r.data + r.size);  // an error path: the whole payload, offsets unchanged
      copy->data = copy->owned.data();
      copy->failed = false;
      *it = copy;
    } else {
      p.sends.erase(it);
    }
    return;
  }
}

uint64_t Links::early_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return early_bytes_;
}

std::string Links::broken_reason(int peer) const {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!peers_.at(peer)) return std::string();
  const Peer& p = *peers_[peer];
  return p.broken.empty() ? p.send_broken : p.broken;
}

void Links::wake_poller() {
  const uint64_t one = 1;
  (void)!::write(wake_fd_, &one, sizeof(one));
}

void Links::abort() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    aborted_ = true;
  }
  wake_poller();
  rounds_.notify_all();
}

void Links::prepare_poll() {
  // Reused across rounds: only the polling thread touches them.
  std::vector<pollfd>& fds = poll_fds_;
  std::vector<Peer*>& who = poll_peers_;
  fds.assign(1, pollfd{wake_fd_, POLLIN, 0});
  who.assign(1, nullptr);
  for (auto& p : peers_) {
    if (!p || !p->broken.empty()) continue;
    const short in = p->held ? 0 : POLLIN;  // a held message stays in the socket
    fds.push_back({p->fd, static_cast<short>(in | (p->sends.empty() ? 0 : POLLOUT)), 0});
    who.push_back(p.get());
  }
}

void Links::poll_round(std::unique_lock<std::mutex>& lock, Clock::time_point deadline) {
  release_held();  // about to sleep: nothing may wait on a held message (Note [Large messages wait in the socket])
  prepare_poll();
  PollingRound round(polling_, rounds_);
  poll_ready(lock, ms_until(deadline));
}

void Links::poll_ready(std::unique_lock<std::mutex>& lock, int timeout_ms) {
  std::vector<pollfd>& fds = poll_fds_;
  std::vector<Peer*>& who = poll_peers_;
  if (timeout_ms > 0) lock.unlock();  // blocking: let posters in meanwhile
  const int rc = ::poll(fds.data(), fds.size(), timeout_ms);
  if (timeout_ms > 0) lock.lock();
  if (rc > 0) {
    if (fds[0].revents & POLLIN) {
      uint64_t v;
      (void)!::read(wake_fd_, &v, sizeof(v));
    }
    for (size_t i = 1; i < fds.size(); ++i) {
      if (fds[i].revents & POLLOUT) write_pending(*who[i]);
      if (fds[i].revents & (POLLIN | POLLERR | POLLHUP)) read_available(*who[i]);
    }
  }
}

void Links::spin_round(std::unique_lock<std::mutex>& lock, const Request& r) {
  const auto start = Clock::now();
  const bool large = static_cast<int64_t>(r.size) > waits_.large_bytes;
  const auto spin_until = start + waits_.spin, until = spin_until + (large ? waits_.large_yield : waits_.yield);
  PollingRound round(polling_, rounds_);  // the others wait for this round as for a poll
  while (!r.done && !r.failed && !aborted_ && Clock::now() < until) {
    if (Clock::now() < spin_until) {
      for (auto& p : peers_) {
        if (!p || !p->broken.empty()) continue;
        if (!p->sends.empty()) write_pending(*p);
        read_available(*p);
      }
    } else {  // yielding: one poll() finds the sockets with work, where reading each is a call per peer
      prepare_poll();
      poll_ready(lock, 0);
    }
    if (r.done || r.failed) break;
    lock.unlock();  // let a poster in
    if (Clock::now() >= spin_until) sched_yield();  // cores shared: let the peer run
    lock.lock();
  }
}

WaitResult Links::wait(Request& r, std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  std::unique_lock<std::mutex> lock(mutex_);
  bool spun = waits_.spin.count() == 0 && waits_.yield.count() == 0 && waits_.large_yield.count() == 0;
  for (;;) {
    if (r.done) return WaitResult::kDone;
    if (r.too_large) return WaitResult::kTooLarge;
    if (r.failed) return WaitResult::kBroken;
    if (aborted_) return WaitResult::kAborted;
    if (Clock::now() >= deadline) return WaitResult::kTimeout;
    if (polling_) {  // another thread polls: its rounds progress this request too
      rounds_.wait_until(lock, deadline);
      continue;
    }
    if (!spun) {
      spin_round(lock, r);
      spun = true;
      continue;
    }
    poll_round(lock, deadline);
  }
}

}  // namespace tcp
}  // namespace comm
}  // namespace meshtrain
