// Store clients: PrefixStore, TcpStore and FailureWatcher. The server is in
// store_server.cpp; the wire protocol is in store_protocol.h.

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <thread>

#include "meshtrain/comm.h"
#include "comm/store.h"
#include "meshtrain/util.h"
#include "util/strings.h"
#include "socket.h"
#include "store_auth.h"
#include "store_protocol.h"

namespace meshtrain {
namespace comm {

using net::Clock;

namespace {

// Why a store connection broke: the store's process went away (its kernel
// closed the connection), or its host stopped answering (Note [Silent links]).
std::string lost_store(const std::string& host, int port, int error) {
  return net::link_went_silent(error)
             ? str_cat("lost the connection to the rendezvous store at ", host, ":", port, ": ",
                       net::silent_link_reason(host))
             : str_cat("lost the connection to the rendezvous store at ", host, ":", port,
                       " (the process hosting it, rank 0 or the launcher, exited)");
}

}  // namespace

void PrefixStore::set(const std::string& key, const std::string& value) { base_->set(k(key), value); }
std::string PrefixStore::get(const std::string& key) { return base_->get(k(key)); }
int64_t PrefixStore::add(const std::string& key, int64_t delta) { return base_->add(k(key), delta); }
bool PrefixStore::check(const std::string& key) { return base_->check(k(key)); }
void PrefixStore::wait(const std::vector<std::string>& keys) {
  std::vector<std::string> prefixed;
  for (const auto& key : keys) prefixed.push_back(k(key));
  base_->wait(prefixed);
}

TcpStore::TcpStore(const std::string& host, int port, std::chrono::milliseconds timeout, const std::string& token,
                   const std::string& token_origin)
    : host_(host), port_(port), token_(token), timeout_(timeout) {
  fd_ = net::connect_to(host, port, Clock::now() + timeout, "the rendezvous store");
  try {
    authenticated_ = store_auth::prove(fd_, token_, Clock::now() + timeout,
                                       str_cat("the rendezvous store at ", host, ":", port), token_origin);
  } catch (...) {
    ::close(fd_);
    throw;
  }
}

TcpStore::~TcpStore() {
  if (fd_ >= 0) ::close(fd_);
}

std::string TcpStore::request(const std::string& frame) {
  std::lock_guard<std::mutex> lock(mutex_);
  std::string reply;
  if (!broken_.empty()) throw PeerFailure(broken_, -1);
  if (fd_ < 0 || !net::write_frame(fd_, frame) ||
      !net::read_frame(fd_, &reply, Clock::now() + timeout_)) {
    // A send on a connection the kernel already gave up says EPIPE; why it gave up is in SO_ERROR.
    int error = errno, pending = 0;
    socklen_t len = sizeof pending;
    if (fd_ >= 0 && ::getsockopt(fd_, SOL_SOCKET, SO_ERROR, &pending, &len) == 0 && pending != 0) error = pending;
    broken_ = lost_store(host_, port_, error);  // every later request says the same
    throw PeerFailure(broken_, -1);
  }
  return reply;
}

void TcpStore::set(const std::string& key, const std::string& value) {
  request(net::Writer().u8(store_protocol::kSet).str(key).str(value).bytes());
}

std::string TcpStore::get(const std::string& key) {
  const auto deadline = Clock::now() + timeout_;
  auto backoff = std::chrono::milliseconds(1);
  while (true) {
    const std::string reply = request(net::Writer().u8(store_protocol::kGet).str(key).bytes());
    net::Reader r(reply);
    if (r.u8() == store_protocol::kFound) return r.str();
    if (interrupt_) interrupt_();
    if (Clock::now() > deadline) {
      throw TimeoutError(str_cat("rendezvous key '", key, "' was not set within ", timeout_.count(),
                                 " ms: a rank did not arrive (is every rank started, with the "
                                 "same WORLD_SIZE?)"));
    }
    std::this_thread::sleep_for(backoff);
    backoff = std::min(backoff * 2, std::chrono::milliseconds(20));
  }
}

int64_t TcpStore::add(const std::string& key, int64_t delta) {
  const std::string reply =
      request(net::Writer().u8(store_protocol::kAdd).str(key).i64(delta).bytes());
  net::Reader r(reply);
  r.u8();
  return r.i64();
}

bool TcpStore::check(const std::string& key) {
  const std::string reply = request(net::Writer().u8(store_protocol::kCheck).str(key).bytes());
  net::Reader r(reply);
  return r.u8() == store_protocol::kFound;
}

void TcpStore::wait(const std::vector<std::string>& keys) {
  for (const auto& key : keys) get(key);
}

void TcpStore::hello(const std::string& label) {
  request(net::Writer().u8(store_protocol::kHello).str(label).bytes());
}

void TcpStore::bye() { request(net::Writer().u8(store_protocol::kBye).bytes()); }

void TcpStore::report_failure(const std::string& label, const std::string& reason) {
  request(net::Writer().u8(store_protocol::kReport).str(label).str(reason).bytes());
}

std::string refusals_seen(TcpStore& store) {
  try {
    if (!store.check(kRefusalsKey)) return "";
    std::vector<std::string> lines = split(trim(store.get(kRefusalsKey)), '\n');
    return "the store refused " + join(lines, ", ");
  } catch (const std::exception&) {  // the store went away: its refusals are not the news
    return "";
  }
}

FailureWatcher::FailureWatcher(const std::string& host, int port, const std::string& prefix,
                               std::chrono::milliseconds connect_timeout,
                               std::function<void(const FailureReport&)> on_failure, const std::string& token)
    : host_(host), port_(port), on_failure_(std::move(on_failure)) {
  fd_ = net::connect_to(host, port, Clock::now() + connect_timeout, "the rendezvous store");
  try {
    store_auth::prove(fd_, token, Clock::now() + connect_timeout, str_cat("the rendezvous store at ", host, ":", port),
                      "MESHTRAIN_RDZV_TOKEN");
  } catch (...) {
    ::close(fd_);
    throw;
  }
  net::write_frame(fd_, net::Writer().u8(store_protocol::kWatch).str(prefix).bytes());
  thread_ = std::thread([this] { run(); });
}

FailureWatcher::~FailureWatcher() {
  stop();
  if (thread_.joinable()) thread_.join();
  if (fd_ >= 0) ::close(fd_);
}

void FailureWatcher::stop() {
  if (!stopping_.exchange(true) && fd_ >= 0) ::shutdown(fd_, SHUT_RDWR);
}

std::string FailureWatcher::link_trouble() const {
  if (fd_ < 0 || stopping_ || !(answer_unacknowledged_ || net::link_retransmitting(fd_))) return "";
  return str_cat("lost the connection to the rendezvous store at ", host_, ":", port_, ": the link to ", host_,
                 " went silent one way: what this host sends is not acknowledged any more; the network from this "
                 "host to ", host_, " is cut");
}

void FailureWatcher::run() {
  std::string frame;
  const int check_ms = static_cast<int>(std::chrono::milliseconds(net::link_timeout()).count() / 4);
  while (true) {
    // Between frames, each quarter of the link time-out: does the store
    // acknowledge what this host sends? (Behind a one-way cut the store's
    // heartbeats stop at the first, which cannot be acknowledged.)
    pollfd readable{fd_, POLLIN, 0};
    if (::poll(&readable, 1, check_ms) == 0) {
      answer_unacknowledged_ = net::link_retransmitting(fd_);
      continue;
    }
    bool ok = false;
    int error = 0;
    try {
      ok = net::read_frame(fd_, &frame, Clock::time_point::max());
      error = errno;
    } catch (const std::exception&) {
      ok = false;
    }
    if (!ok) {
      // The store, once it finds this host cut off, closes its connections;
      // a cut that lets only the store's side through shows that as an end.
      const std::string trouble = link_trouble();
      if (!stopping_) on_failure_({"<store>", trouble.empty() ? lost_store(host_, port_, error) : trouble});
      return;
    }
    if (stopping_) return;
    net::Reader r(frame);
    const uint8_t kind = r.u8();
    if (kind == store_protocol::kHeartbeat) {  // answered so that a cut towards the server shows here too
      answer_unacknowledged_ = net::link_retransmitting(fd_);
      net::write_frame(fd_, net::Writer().u8(store_protocol::kHeartbeat).bytes());  // (Note [Heartbeats])
      continue;
    }
    if (kind != store_protocol::kFailure) continue;
    FailureReport report;
    report.label = r.str();
    report.reason = r.str();
    on_failure_(report);
  }
}

}  // namespace comm
}  // namespace meshtrain
