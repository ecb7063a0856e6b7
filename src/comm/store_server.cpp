// StoreServer: one thread, poll(2) over the listening socket and the clients.
// See Note [Failure detection] below.

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <map>

#include "comm/store.h"
#include "meshtrain/util.h"
#include "socket.h"
#include "store_auth.h"
#include "store_protocol.h"

namespace meshtrain {
namespace comm {

// Note [Failure detection]
// A rank registers its store connection with hello(label). The kernel closes
// that connection when the process dies for any reason (SIGKILL included), and
// the server sees EOF at once: if the client had not said bye(), its label is
// recorded as failed and pushed to every FailureWatcher whose prefix matches.
// Watchers abort the waits of their process's communicators (see
// TcpCommunicator), so every survivor raises PeerFailure naming the dead rank
// within milliseconds. A process that is alive but stuck keeps its connection
// open; the survivors then fail at their communication timeout instead.
//
// Note [Heartbeats]
// TCP keepalive (Note [Silent links] in socket.h) finds a link cut both ways,
// but not a one-way cut: the side that still receives sees the other's
// keepalive probes and retransmissions arrive, counts the link as alive, and
// never learns that what it sends is lost (node 0 then blamed a healthy rank
// as stuck at --comm-timeout, or one that "died" when its FIN got through).
// Only data that goes unacknowledged times out on both sides. So the server
// sends a kHeartbeat frame on every watcher's connection each quarter of the
// link time-out, and the watcher sends one back: whichever direction is cut,
// some heartbeat stays unacknowledged and TCP_USER_TIMEOUT breaks that
// connection with ETIMEDOUT within the link time-out. A host is one place: when
// any connection from it goes silent, the server counts every connection from
// that address as silent and reports each of its labelled processes as
// unreachable (kUnreachableReport), not dead.

namespace {

using net::Clock;

constexpr size_t kMaxUnauthenticatedFrame = 4096;  // an kAuth frame is ~50 bytes
constexpr size_t kMaxQueuedReplies = 64u << 20;    // a client that does not read its replies
constexpr size_t kMaxClients = 4096;
constexpr auto kTimeToAuthenticate = std::chrono::seconds(10);
constexpr int kRefusalsShown = 20;
constexpr long kRefusalsRecorded = 5;  // lines under kRefusalsKey

struct Client {
  int fd = -1;
  std::string peer;  // "127.0.0.1:40312", for messages
  Clock::time_point accepted;
  std::string nonce;  // the challenge; "" once authenticated (or with no token)
  std::string inbuf, outbuf;
  bool dropped = false;  // closed at the end of this round
  bool reset = false;    // refused: closed with a reset, dropping what its socket still holds
  std::string label;
  bool said_bye = false;
  bool went_silent = false;  // its host stopped answering (Note [Silent links] in socket.h)
  bool deaf_host = false;    // ... or closed it while its host heard nothing from here (Note [Heartbeats])
  std::chrono::milliseconds silent_after = net::link_timeout();  // a watcher's is shorter
  bool watching = false;
  std::string watch_prefix;
};

// "10.0.0.2" of a peer "10.0.0.2:40312".
std::string host_of(const std::string& peer) { return peer.substr(0, peer.rfind(':')); }

bool starts_with(const std::string& s, const std::string& prefix) {
  return s.compare(0, prefix.size(), prefix) == 0;
}

std::string peer_of(int fd) {
  sockaddr_storage addr{};
  socklen_t len = sizeof addr;
  char host[INET6_ADDRSTRLEN] = "?";
  int port = 0;
  if (::getpeername(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
    if (addr.ss_family == AF_INET) {
      auto* a = reinterpret_cast<sockaddr_in*>(&addr);
      inet_ntop(AF_INET, &a->sin_addr, host, sizeof host);
      port = ntohs(a->sin_port);
    } else if (addr.ss_family == AF_INET6) {
      auto* a = reinterpret_cast<sockaddr_in6*>(&addr);
      inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof host);
      port = ntohs(a->sin6_port);
    }
  }
  return std::string(host) + ":" + std::to_string(port);
}

}  // namespace

struct StoreServer::State {
  mutable std::mutex mutex;
  std::condition_variable changed;
  std::string token;
  std::map<std::string, std::string> kv;
  std::map<int, Client> clients;  // by fd
  std::vector<FailureReport> failures;
  int refusals = 0;
  Clock::time_point last_heartbeat = Clock::now();
  const Clock::duration heartbeat_interval = std::chrono::milliseconds(net::link_timeout()) / 4;
  // Per host, since when a heartbeat to it has gone unanswered (absent: it answered, or connected, since).
  std::map<std::string, Clock::time_point> unanswered_since;

  int labeled_clients_present() const {
    int n = 0;
    for (const auto& kv : clients) n += (!kv.second.label.empty() && !kv.second.said_bye);
    return n;
  }

  // A connection closed by the server: said on stderr (the first few), as a
  // stranger's attempt or a broken client is worth knowing about.
  void refuse(Client& c, const std::string& why) {
    c.dropped = true;
    c.reset = true;
    if (++refusals <= kRefusalsShown) {
      std::fprintf(stderr, "meshtrain store: closed the connection from %s: %s%s\n", c.peer.c_str(), why.c_str(),
                   refusals == kRefusalsShown ? " (further ones not shown)" : "");
    }
  }

  // Queues a frame for `c` and sends what the socket takes now; never blocks.
  void send(Client& c, const std::string& payload) {
    if (c.dropped) return;
    c.outbuf += net::frame_of(payload);
    flush(c);
    if (c.outbuf.size() > kMaxQueuedReplies) refuse(c, "it does not read its replies (64 MiB queued)");
  }

  void flush(Client& c) {
    while (!c.outbuf.empty() && !c.dropped) {
      const ssize_t n = ::send(c.fd, c.outbuf.data(), c.outbuf.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
      if (n <= 0) {
        c.went_silent = n < 0 && net::link_went_silent(errno);
        c.dropped = true;
        return;
      }
      c.outbuf.erase(0, static_cast<size_t>(n));
    }
  }

  // Sends a heartbeat to every watcher once per interval (Note [Heartbeats]). Caller holds mutex.
  void heartbeat_watchers() {
    const auto now = Clock::now();
    if (now - last_heartbeat < heartbeat_interval) return;
    last_heartbeat = now;
    const std::string beat = net::Writer().u8(store_protocol::kHeartbeat).bytes();
    for (auto& kv : clients) {
      if (!kv.second.watching || !kv.second.nonce.empty()) continue;
      send(kv.second, beat);
      unanswered_since.emplace(host_of(kv.second.peer), now);  // kept if older
    }
  }

  int ms_to_next_heartbeat() const {
    std::lock_guard<std::mutex> lock(mutex);
    const auto left = last_heartbeat + heartbeat_interval - Clock::now();
    return static_cast<int>(std::clamp<int64_t>(std::chrono::duration_cast<std::chrono::milliseconds>(left).count() + 1,
                                                0, 1000));
  }

  // How long `host` has left a heartbeat unanswered. Caller holds mutex.
  Clock::duration deafness(const std::string& host) const {
    auto it = unanswered_since.find(host);
    return it == unanswered_since.end() ? Clock::duration{0} : Clock::now() - it->second;
  }

  // A process that closed its connection while its host had answered no
  // heartbeat for two intervals did not die: its host could not hear this one
  // (a one-way cut) and gave up. Then, a connection that went silent silences
  // every connection from its host. Caller holds mutex.
  void silence_hosts_of_silent_links() {
    // Only a round that dropped a client can find a silent link (a silent
    // client is dropped and erased in the round that found it): the common
    // round drops none and ends here.
    if (std::none_of(clients.begin(), clients.end(), [](const auto& kv) { return kv.second.dropped; })) return;
    for (auto& kv : clients) {
      Client& c = kv.second;
      if (c.dropped && !c.went_silent && !c.label.empty() && !c.said_bye &&
          deafness(host_of(c.peer)) >= 2 * heartbeat_interval) {
        c.went_silent = c.deaf_host = true;
      }
    }
    std::map<std::string, std::chrono::milliseconds> silent;  // host -> after how long
    for (const auto& kv : clients) {
      if (kv.second.went_silent) silent.emplace(host_of(kv.second.peer), kv.second.silent_after);
    }
    for (auto& kv : clients) {
      Client& c = kv.second;
      auto it = silent.find(host_of(c.peer));
      if (c.went_silent || it == silent.end()) continue;
      c.went_silent = true;
      c.silent_after = it->second;
      c.dropped = true;
    }
  }

  // Records a failure and pushes it to matching watchers. Caller holds mutex.
  void fail(const std::string& label, const std::string& reason) {
    failures.push_back({label, reason});
    const std::string frame =
        net::Writer().u8(store_protocol::kFailure).str(label).str(reason).bytes();
    for (auto& kv : clients) {
      if (kv.second.watching && starts_with(label, kv.second.watch_prefix)) send(kv.second, frame);
    }
  }

  void accept(int fd) {
    if (clients.size() >= kMaxClients) {
      Client stranger;
      stranger.peer = peer_of(fd);
      refuse(stranger, "the store already has 4096 connections");
      ::close(fd);
      return;
    }
    net::watch_link(fd);
    Client& c = clients[fd];
    c.fd = fd;
    c.peer = peer_of(fd);
    c.accepted = Clock::now();
    c.nonce = token.empty() ? "" : store_auth::random_bytes(32);
    send(c, net::Writer().u8(store_protocol::kGreeting).str(c.nonce).bytes());
  }

  // A client refused before it proved the token (`what` says how): logged, and
  // the first few recorded under kRefusalsKey for the waiting lines of the
  // launchers and ranks. Nothing else: it proved nothing, so nothing it says
  // may end or change the rendezvous (Note [Token mismatch] in app/launch/launcher.cpp).
  void refuse_unproven(Client& c, const std::string& what) {
    std::string& recorded = kv[kRefusalsKey];
    if (std::count(recorded.begin(), recorded.end(), '\n') < kRefusalsRecorded) {
      recorded += str_cat("a process at ", c.peer, " (", what, ")\n");
    }
    refuse(c, what);
  }

  // The first frame of a client that must prove it knows the token.
  void authenticate(Client& c, const std::string& frame) {
    net::Reader r(frame);
    const uint8_t cmd = r.u8();
    if (cmd == store_protocol::kDecline) {
      return refuse_unproven(c, "it came with no rendezvous token, and this job has one");
    }
    if (cmd != store_protocol::kAuth) {
      return refuse_unproven(c, "it sent a request before proving it knows the job's token");
    }
    if (!store_auth::same_mac(r.str(), store_auth::mac(token, c.nonce))) {
      send(c, net::Writer().u8(store_protocol::kError).bytes());
      return refuse_unproven(c, "it came with another rendezvous token than this job's");
    }
    c.nonce.clear();
    send(c, net::Writer().u8(store_protocol::kOk).bytes());
  }

  // Every complete frame in the client's buffer (consumed once at the end);
  // a length over the bound closes the connection.
  void handle_frames(Client& c) {
    size_t pos = 0;
    while (c.inbuf.size() - pos >= 4 && !c.dropped) {
      uint32_t len;
      std::memcpy(&len, c.inbuf.data() + pos, 4);
      if (len > (c.nonce.empty() ? net::kMaxFrame : kMaxUnauthenticatedFrame)) {
        return refuse(c, str_cat("a frame of ", len, " bytes, over the bound"));
      }
      if (c.inbuf.size() - pos < 4 + static_cast<size_t>(len)) break;
      const std::string frame = c.inbuf.substr(pos + 4, len);
      pos += 4 + static_cast<size_t>(len);
      try {
        if (!c.nonce.empty()) authenticate(c, frame);
        else handle(c, frame);
      } catch (const std::exception&) {
        send(c, net::Writer().u8(store_protocol::kError).bytes());
      }
    }
    c.inbuf.erase(0, pos);
  }

  // Handles one request frame from `c`. Caller holds mutex.
  void handle(Client& c, const std::string& frame) {
    net::Reader r(frame);
    const uint8_t cmd = r.u8();
    net::Writer reply;
    switch (cmd) {
      case store_protocol::kSet: {
        std::string key = r.str();
        kv[key] = r.str();
        reply.u8(store_protocol::kOk);
        break;
      }
      case store_protocol::kGet:
      case store_protocol::kCheck: {
        auto it = kv.find(r.str());
        if (it == kv.end()) {
          reply.u8(store_protocol::kMissing);
        } else {
          reply.u8(store_protocol::kFound);
          if (cmd == store_protocol::kGet) reply.str(it->second);
        }
        break;
      }
      case store_protocol::kAdd: {
        std::string key = r.str();
        const int64_t delta = r.i64();
        int64_t value = 0;
        auto it = kv.find(key);
        if (it != kv.end() && it->second.size() == 8) std::memcpy(&value, it->second.data(), 8);
        value += delta;
        kv[key] = std::string(reinterpret_cast<const char*>(&value), 8);
        reply.u8(store_protocol::kOk).i64(value);
        break;
      }
      case store_protocol::kHello:
        c.label = r.str();
        reply.u8(store_protocol::kOk);
        break;
      case store_protocol::kBye:
        c.said_bye = true;
        reply.u8(store_protocol::kOk);
        break;
      case store_protocol::kHeartbeat:  // a watcher's answer: its host hears this one
        unanswered_since.erase(host_of(c.peer));
        return;
      case store_protocol::kReport: {
        std::string label = r.str();
        fail(label, r.str());
        reply.u8(store_protocol::kOk);
        break;
      }
      case store_protocol::kWatch:
        c.watching = true;
        c.watch_prefix = r.str();
        unanswered_since.erase(host_of(c.peer));  // it read the greeting: its host hears this one
        // A heartbeat unacknowledged for a quarter of the link time-out ends
        // this connection, and so every one of its host: with a heartbeat each
        // quarter, within half the link time-out of a cut, while that host's
        // own processes give up on the store only after the whole of it (they
        // hear nothing, and their keepalive counts from the last packet heard):
        // this side names the cut first, with a margin a loaded machine keeps.
        c.silent_after = std::chrono::milliseconds(net::link_timeout()) / 4;
        net::set_unacknowledged_timeout(c.fd, c.silent_after);
        // A watcher that arrives late still learns of earlier failures.
        for (const auto& f : failures) {
          if (starts_with(f.label, c.watch_prefix)) {
            send(c, net::Writer().u8(store_protocol::kFailure).str(f.label).str(f.reason).bytes());
          }
        }
        return;  // watchers get no reply, only pushed failures
      default:
        reply.u8(store_protocol::kError);
    }
    send(c, reply.bytes());
  }

  std::string silent_reason(const Client& c) const {
    const std::string host = host_of(c.peer);
    if (!c.deaf_host) return net::silent_link_reason(host, c.silent_after);
    return str_cat("the link to ", host, " went silent one way: what that host sends arrives, but it answered no "
                   "heartbeat for ", std::chrono::duration_cast<std::chrono::seconds>(deafness(host)).count(),
                   " s and its processes gave up on this one; the network towards it is cut");
  }

  // Called when a client's connection closed. Caller holds mutex.
  void disconnected(Client& c) {
    if (!c.label.empty() && !c.said_bye) {
      fail(c.label, c.went_silent ? str_cat(kUnreachableReport, silent_reason(c))
                                  : "its connection to the store closed without a goodbye: the process died or "
                                    "was killed");
    }
    if (c.reset) {  // a refused client gets no orderly goodbye, and its unread replies are freed now
      const linger abort_now{1, 0};
      ::setsockopt(c.fd, SOL_SOCKET, SO_LINGER, &abort_now, sizeof abort_now);
    }
    ::close(c.fd);
  }
};

StoreServer::StoreServer(const std::string& host, int port, const std::string& token)
    : host_(host), state_(new State) {
  state_->token = token;
  listen_fd_ = net::listen_on(host, port, &port_);
  if (pipe2(wake_pipe_, O_CLOEXEC) != 0) {
    ::close(listen_fd_);
    throw std::runtime_error("StoreServer: pipe2 failed");
  }
  thread_ = std::thread([this] { run(); });
}

StoreServer::~StoreServer() {
  const char byte = 'x';
  if (::write(wake_pipe_[1], &byte, 1) < 0) {
    // The thread also exits when the pipe closes below.
  }
  if (thread_.joinable()) thread_.join();
  for (auto& kv : state_->clients) ::close(kv.first);
  ::close(listen_fd_);
  ::close(wake_pipe_[0]);
  ::close(wake_pipe_[1]);
}

void StoreServer::wait_until_clients_leave(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(state_->mutex);
  state_->changed.wait_for(lock, timeout, [&] { return state_->labeled_clients_present() == 0; });
}

std::vector<FailureReport> StoreServer::failures() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->failures;
}

void StoreServer::run() {
  std::vector<pollfd> fds;
  char buf[65536];
  while (true) {
    fds.clear();
    fds.push_back({wake_pipe_[0], POLLIN, 0});
    fds.push_back({listen_fd_, POLLIN, 0});
    {
      std::lock_guard<std::mutex> lock(state_->mutex);
      for (const auto& kv : state_->clients)
        fds.push_back({kv.first, static_cast<short>(POLLIN | (kv.second.outbuf.empty() ? 0 : POLLOUT)), 0});
    }
    // Wakes for the next heartbeat on time, and each second to expire silent strangers.
    if (::poll(fds.data(), fds.size(), state_->ms_to_next_heartbeat()) < 0) {
      if (errno == EINTR) continue;
      return;
    }
    if (fds[0].revents) return;
    std::lock_guard<std::mutex> lock(state_->mutex);
    state_->heartbeat_watchers();
    if (fds[1].revents & POLLIN) {
      const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
      if (fd >= 0) state_->accept(fd);
    }
    for (size_t i = 2; i < fds.size(); ++i) {
      auto it = state_->clients.find(fds[i].fd);
      if (!fds[i].revents || it == state_->clients.end()) continue;
      Client& c = it->second;
      if (fds[i].revents & POLLOUT) state_->flush(c);
      if (!(fds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      const ssize_t n = ::recv(c.fd, buf, sizeof buf, MSG_DONTWAIT);
      if (n < 0 && (errno == EAGAIN || errno == EINTR)) continue;
      if (n <= 0) {
        c.went_silent = n < 0 && net::link_went_silent(errno);
        c.dropped = true;
        continue;
      }
      c.inbuf.append(buf, static_cast<size_t>(n));
      state_->handle_frames(c);
    }
    drop_closed_clients();
  }
}

// Closes the connections marked dropped, and those that never authenticated in time.
void StoreServer::drop_closed_clients() {
  const auto now = Clock::now();
  state_->silence_hosts_of_silent_links();
  for (auto it = state_->clients.begin(); it != state_->clients.end();) {
    Client& c = it->second;
    if (!c.nonce.empty() && !c.dropped && now - c.accepted > kTimeToAuthenticate) {
      state_->refuse(c, "it did not prove it knows the job's token within 10 s");
    }
    if (!c.dropped) {
      ++it;
      continue;
    }
    state_->disconnected(c);
    it = state_->clients.erase(it);
  }
  state_->changed.notify_all();
}

}  // namespace comm
}  // namespace meshtrain
