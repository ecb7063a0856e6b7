#pragma once
// The rendezvous store: a small key-value service that ranks use to find each
// other (gloo exchanges its addresses through it) and that detects dead
// processes. One StoreServer runs per job (in the launcher, or in rank 0); every
// rank holds a TcpStore client.
//
// Liveness (see Note [Failure detection]): a client says hello(label) once; if
// its connection closes without bye() the server records a failure for that
// label and pushes it to every FailureWatcher. A SIGKILLed rank is therefore
// known to all others within milliseconds, without heartbeats.

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace meshtrain {
namespace comm {

// The job's rendezvous token (Note [Store authentication] in
// src/comm/store_protocol.h): MESHTRAIN_RDZV_TOKEN, or "" when unset (then the
// store takes any client that can reach its port). meshrun makes one per job
// and hands it to its ranks in the environment, never on the command line.
std::string rdzv_token_from_env();
// 32 random bytes as hex, from OpenSSL's generator.
std::string generate_rdzv_token();

// Where a server records the first few connections it refused before they
// proved the job's token (none, another, a request first): one line each,
// "a process at ADDR (it came with ...)". For waiting lines and time-out
// messages only: a refused process proved nothing, so no launcher or rank
// stops on it (Note [Token mismatch] in app/launch/launcher.cpp).
constexpr char kRefusalsKey[] = "meshtrain/refusals";

class Store {
 public:
  virtual ~Store() = default;
  virtual void set(const std::string& key, const std::string& value) = 0;
  // The value of `key`, waiting until some client sets it (TimeoutError after timeout()).
  virtual std::string get(const std::string& key) = 0;
  // Atomically adds delta to the integer at key (0 when absent); returns the new value.
  virtual int64_t add(const std::string& key, int64_t delta) = 0;
  virtual bool check(const std::string& key) = 0;
  virtual void wait(const std::vector<std::string>& keys) = 0;
  virtual std::chrono::milliseconds timeout() const = 0;
};

// Namespaces keys of another store ("<prefix>/<key>").
class PrefixStore : public Store {
 public:
  PrefixStore(std::string prefix, std::shared_ptr<Store> base)
      : prefix_(std::move(prefix)), base_(std::move(base)) {}
  void set(const std::string& key, const std::string& value) override;
  std::string get(const std::string& key) override;
  int64_t add(const std::string& key, int64_t delta) override;
  bool check(const std::string& key) override;
  void wait(const std::vector<std::string>& keys) override;
  std::chrono::milliseconds timeout() const override { return base_->timeout(); }

 private:
  std::string k(const std::string& key) const { return prefix_ + "/" + key; }
  std::string prefix_;
  std::shared_ptr<Store> base_;
};

// A client connection to a StoreServer. Thread-safe.
class TcpStore : public Store {
 public:
  // Connects, retrying until `timeout` while the server is not up yet, and
  // proves it knows the job's token when the server asks. ConfigError when the
  // server wants a token this process lacks or refuses the one it has; the
  // message names `token_origin` (the variable or file the token came from).
  TcpStore(const std::string& host, int port, std::chrono::milliseconds timeout,
           const std::string& token = rdzv_token_from_env(),
           const std::string& token_origin = "MESHTRAIN_RDZV_TOKEN");
  ~TcpStore() override;

  void set(const std::string& key, const std::string& value) override;
  std::string get(const std::string& key) override;
  int64_t add(const std::string& key, int64_t delta) override;
  bool check(const std::string& key) override;
  void wait(const std::vector<std::string>& keys) override;
  std::chrono::milliseconds timeout() const override { return timeout_; }

  // Registers this connection as the process `label` (e.g. "g0/r3"): if it
  // closes before bye(), the server reports `label` as failed.
  void hello(const std::string& label);
  void bye();
  // Records a failure of `label` (e.g. the launcher saw a rank exit) and pushes it to watchers.
  void report_failure(const std::string& label, const std::string& reason);
  // Called between polls of get()/wait(); may throw to abort the wait (a peer died).
  void set_interrupt(std::function<void()> check) { interrupt_ = std::move(check); }

  const std::string& host() const { return host_; }
  int port() const { return port_; }
  const std::string& token() const { return token_; }
  // Whether the server asked for the token (false: it serves any client,
  // whatever token this process has; see Note [Token mismatch]).
  bool authenticated() const { return authenticated_; }

 private:
  std::string request(const std::string& frame);
  std::string host_;
  int port_;
  std::string token_;
  bool authenticated_ = false;
  std::string broken_;  // why the connection broke, once it has
  std::chrono::milliseconds timeout_;
  int fd_ = -1;
  std::mutex mutex_;
  std::function<void()> interrupt_;
};

// "the store refused a process at ADDR (it came with ...)" for the lines
// recorded under kRefusalsKey, "" when there are none. Never throws (a store
// gone away says nothing here).
std::string refusals_seen(TcpStore& store);

// A failure pushed by the server: `label` died or was reported failed.
struct FailureReport {
  std::string label;
  std::string reason;
};
// The reason of a report that a rank stopped making progress (rather than
// died) starts with this (Note [Naming a stuck rank] in src/comm/process.cpp).
constexpr char kStuckReport[] = "stuck: ";
// ... and that its host stopped answering (Note [Silent links] in src/comm/socket.h).
constexpr char kUnreachableReport[] = "unreachable: ";
// ... and that a process stopped with an error before its world was made (Note
// [Start-up reports] in src/comm/process.cpp): acted on only by ranks still in
// their rendezvous.
constexpr char kStartupReport[] = "start-up: ";

// Watches the server for failures of labels starting with `prefix`, on its own
// connection and thread, and calls `on_failure` for each (from that thread).
// If the server itself disappears, reports label "<store>".
class FailureWatcher {
 public:
  FailureWatcher(const std::string& host, int port, const std::string& prefix,
                 std::chrono::milliseconds connect_timeout,
                 std::function<void(const FailureReport&)> on_failure,
                 const std::string& token = rdzv_token_from_env());
  ~FailureWatcher();
  // Stop reporting (before a clean shutdown, when the server may go away first).
  void stop();
  // Why the link to the store looks cut one way (what this host sends waits
  // for an acknowledgement past a retransmission time-out), or "" (Note
  // [Heartbeats] in src/comm/store_server.cpp).
  std::string link_trouble() const;

 private:
  void run();
  std::string host_;
  int port_ = 0;
  int fd_ = -1;
  std::atomic<bool> stopping_{false};
  std::atomic<bool> answer_unacknowledged_{false};  // at the last heartbeat, the answer before it was
  std::function<void(const FailureReport&)> on_failure_;
  std::thread thread_;
};

// The server. Binds only `host` (never all interfaces); port 0 picks a free port.
// With a token, only clients that prove they know it are served (a stranger's
// connection is closed and said on stderr). Every connection is bounded: frames
// up to 64 MiB (4 KiB before it authenticates), replies queued without blocking
// the server (a client that does not read them is dropped past 64 MiB), 10 s to
// authenticate, at most 4096 connections.
class StoreServer {
 public:
  StoreServer(const std::string& host, int port, const std::string& token = rdzv_token_from_env());
  ~StoreServer();
  int port() const { return port_; }
  const std::string& host() const { return host_; }
  // Waits until every client that said hello has said bye or disconnected, at
  // most `timeout` (rank 0 hosting the store waits so others can finish).
  void wait_until_clients_leave(std::chrono::milliseconds timeout);
  // Failures recorded so far (labels and reasons).
  std::vector<FailureReport> failures() const;

 private:
  struct State;
  void run();
  void drop_closed_clients();
  std::string host_;
  int port_ = 0;
  int listen_fd_ = -1;
  int wake_pipe_[2] = {-1, -1};
  std::unique_ptr<State> state_;
  std::thread thread_;
};

}  // namespace comm
}  // namespace meshtrain
