// StoreServer: one thread, poll(2) over the listening socket and the clients.
// See Note [Failure detection] below.

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <condition_variable>
#include <cstring>
#include <map>

#include "meshtrain/comm/store.h"
#include "socket.h"
#include "store_protocol.h"

namespace meshtrain {
namespace comm {

// Note [Failure detection]
// A rank registers its store connection with hello(label). The kernel closes
// that connection when the process dies for any reason (SIGKILL included), and
// the server sees EOF at once: if the client had not said bye(), its label is
// recorded as failed and pushed to every FailureWatcher whose prefix matches.
// Watchers abort the waits of their process's communicators (see
// GlooCommunicator), so every survivor raises PeerFailure naming the dead rank
// within milliseconds. A process that is alive but stuck keeps its connection
// open; the survivors then fail at their communication timeout instead.

namespace {

struct Client {
  int fd = -1;
  std::string inbuf;
  std::string label;
  bool said_bye = false;
  bool watching = false;
  std::string watch_prefix;
};

bool starts_with(const std::string& s, const std::string& prefix) {
  return s.compare(0, prefix.size(), prefix) == 0;
}

}  // namespace

struct StoreServer::State {
  mutable std::mutex mutex;
  std::condition_variable changed;
  std::map<std::string, std::string> kv;
  std::map<int, Client> clients;  // by fd
  std::vector<FailureReport> failures;

  int labeled_clients_present() const {
    int n = 0;
    for (const auto& kv : clients) n += (!kv.second.label.empty() && !kv.second.said_bye);
    return n;
  }

  // Records a failure and pushes it to matching watchers. Caller holds mutex.
  void fail(const std::string& label, const std::string& reason) {
    failures.push_back({label, reason});
    const std::string frame =
        net::Writer().u8(store_protocol::kFailure).str(label).str(reason).bytes();
    for (auto& kv : clients) {
      if (kv.second.watching && starts_with(label, kv.second.watch_prefix)) {
        net::write_frame(kv.second.fd, frame);
      }
    }
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
      case store_protocol::kReport: {
        std::string label = r.str();
        fail(label, r.str());
        reply.u8(store_protocol::kOk);
        break;
      }
      case store_protocol::kWatch:
        c.watching = true;
        c.watch_prefix = r.str();
        // A watcher that arrives late still learns of earlier failures.
        for (const auto& f : failures) {
          if (starts_with(f.label, c.watch_prefix)) {
            net::write_frame(c.fd, net::Writer()
                                       .u8(store_protocol::kFailure)
                                       .str(f.label)
                                       .str(f.reason)
                                       .bytes());
          }
        }
        return;  // watchers get no reply, only pushed failures
      default:
        reply.u8(store_protocol::kError);
    }
    net::write_frame(c.fd, reply.bytes());
  }

  // Called when a client's connection closed. Caller holds mutex.
  void disconnected(Client& c) {
    if (!c.label.empty() && !c.said_bye) {
      fail(c.label, "its connection to the store closed without a goodbye: the process died or "
                    "was killed");
    }
    ::close(c.fd);
  }
};

StoreServer::StoreServer(const std::string& host, int port)
    : host_(host), state_(new State) {
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
      for (const auto& kv : state_->clients) fds.push_back({kv.first, POLLIN, 0});
    }
    if (::poll(fds.data(), fds.size(), -1) < 0) {
      if (errno == EINTR) continue;
      return;
    }
    if (fds[0].revents) return;
    std::lock_guard<std::mutex> lock(state_->mutex);
    if (fds[1].revents & POLLIN) {
      const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
      if (fd >= 0) state_->clients[fd].fd = fd;
    }
    for (size_t i = 2; i < fds.size(); ++i) {
      if (!fds[i].revents) continue;
      Client& c = state_->clients[fds[i].fd];
      const ssize_t n = ::recv(c.fd, buf, sizeof buf, MSG_DONTWAIT);
      if (n < 0 && (errno == EAGAIN || errno == EINTR)) continue;
      if (n <= 0) {
        state_->disconnected(c);
        state_->clients.erase(fds[i].fd);
        state_->changed.notify_all();
        continue;
      }
      c.inbuf.append(buf, static_cast<size_t>(n));
      // Handle every complete frame in the buffer.
      while (c.inbuf.size() >= 4) {
        uint32_t len;
        std::memcpy(&len, c.inbuf.data(), 4);
        if (c.inbuf.size() < 4 + static_cast<size_t>(len)) break;
        const std::string frame = c.inbuf.substr(4, len);
        c.inbuf.erase(0, 4 + static_cast<size_t>(len));
        try {
          state_->handle(c, frame);
        } catch (const std::exception&) {
          net::write_frame(c.fd, net::Writer().u8(store_protocol::kError).bytes());
        }
      }
      state_->changed.notify_all();
    }
  }
}

}  // namespace comm
}  // namespace meshtrain
