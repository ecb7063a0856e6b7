#include "process.h"

#include <gloo/transport/tcp/device.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <set>
#include <thread>

#include "meshtrain/comm/errors.h"
#include "meshtrain/util/error.h"

namespace meshtrain {
namespace comm {

std::string host_identity() {
  const char* forced = std::getenv("MESHTRAIN_HOST_ID");
  if (forced && *forced) return forced;
  char name[256] = {0};
  gethostname(name, sizeof name - 1);
  std::string boot_id;
  std::ifstream("/proc/sys/kernel/random/boot_id") >> boot_id;
  return std::string(name) + "/" + boot_id;
}

Process::Process(ProcessConfig config, std::shared_ptr<TcpStore> store,
                 std::unique_ptr<StoreServer> server)
    : config_(std::move(config)), store_(std::move(store)), server_(std::move(server)) {
  const std::string prefix = config_.group + "/";
  watcher_.reset(new FailureWatcher(store_->host(), store_->port(), prefix, config_.timeout,
                                    [this](const FailureReport& r) { on_failure(r); }, store_->token()));
  // Before hello: a rank refused here must not be reported dead under the label of the rank it collided with.
  const int64_t claims = store_->add(prefix + "claims/r" + std::to_string(config_.rank), 1);
  MESHTRAIN_CHECK(claims == 1, "rank ", config_.rank, " has already joined the store at ", store_->host(), ":",
                  store_->port(), ": another job is using the same MASTER_PORT, or two processes were given RANK=",
                  config_.rank, "; give each job its own port (meshrun --standalone or --master-port 0 picks a free one)");
  store_->hello(prefix + "r" + std::to_string(config_.rank));
  store_->set(prefix + "host/" + std::to_string(config_.rank), config_.host_id);
  if (!store_->authenticated()) check_token_like_rank_0();
  // A rendezvous wait (exchanging addresses or segment names) also ends when a peer dies.
  store_->set_interrupt([this] {
    if (auto f = failure()) {
      throw PeerFailure(str_cat("rank ", rank_of_label(f->label),
                                " failed during the rendezvous: ", f->reason),
                        rank_of_label(f->label));
    }
  });
}

// Note [Token mismatch] (src/launch/launcher.cpp), for ranks: with a store
// that takes no token, a rank holding one would make its Gloo pairs prove it
// (Note [Authenticated pairs]) to peers that do not, and both would wait until
// the communication timeout. So every rank says whether it holds one, and a
// rank that differs from rank 0 stops at once, naming the variable.
void Process::check_token_like_rank_0() {
  const std::string key = config_.group + "/has_token/";
  const std::string mine = store_->token().empty() ? "none" : "one";
  store_->set(key + std::to_string(config_.rank), mine);
  if (config_.rank == 0) return;
  const std::string rank0 = store_->get(key + "0");
  MESHTRAIN_CHECK(rank0 == mine, "rank ", config_.rank, " has ", mine == "one" ? "a" : "no", " rendezvous token ",
                  "(MESHTRAIN_RDZV_TOKEN) and rank 0 has ", rank0, ": set the same MESHTRAIN_RDZV_TOKEN for every ",
                  "rank (meshrun does, from --rdzv-token-file: give every node's meshrun the same file), or none anywhere");
}

Process::~Process() {
  // Order matters: stop watching before anyone may go away legitimately, say
  // goodbye, and, when hosting the store, let the other ranks say theirs.
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  recorder_wake_.notify_all();
  if (recorder_.joinable()) recorder_.join();  // it writes to the store
  if (watcher_) watcher_->stop();
  try {
    store_->bye();
  } catch (const std::exception&) {
    // The store host is gone; nothing to tell it.
  }
  store_.reset();
  if (server_) server_->wait_until_clients_leave(config_.timeout);
  watcher_.reset();
  device_.reset();
}

std::shared_ptr<gloo::transport::Device> Process::gloo_device() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!device_) {
    gloo::transport::tcp::attr attr;
    attr.hostname = config_.bind_host;
    try {
      device_ = gloo::transport::tcp::CreateDevice(attr);
    } catch (const std::exception& e) {
      throw ConfigError(str_cat("cannot create the Gloo TCP transport on address '", config_.bind_host,
                                "': ", e.what(), "; set MESHTRAIN_BIND_ADDR to an address of this machine"));
    }
  }
  return device_;
}

void Process::load_hosts() {
  if (!hosts_.empty()) return;
  std::vector<std::string> hosts(config_.world_size);
  for (int r = 0; r < config_.world_size; ++r) {
    hosts[r] = store_->get(config_.group + "/host/" + std::to_string(r));
  }
  hosts_ = std::move(hosts);
}

const std::string& Process::host_of(int global_rank) {
  load_hosts();
  return hosts_.at(global_rank);
}

int Process::ranks_on_my_host() {
  load_hosts();
  int n = 0;
  for (const auto& h : hosts_) n += h == hosts_[config_.rank];
  return n;
}

std::optional<FailureReport> Process::failure() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return failure_;
}

std::optional<FailureReport> Process::await_failure(std::chrono::milliseconds grace) const {
  const auto deadline = std::chrono::steady_clock::now() + grace;
  while (std::chrono::steady_clock::now() < deadline) {
    if (auto f = failure()) return f;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return failure();
}

int Process::rank_of_label(const std::string& label) {
  const auto pos = label.rfind("/r");
  if (pos == std::string::npos) return -1;
  try {
    return std::stoi(label.substr(pos + 2));
  } catch (const std::exception&) {
    return -1;
  }
}

void Process::register_wait(const void* key, int peer, std::chrono::steady_clock::duration long_after,
                            std::function<void()> abort) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (failure_) abort();
  waiting_[key] = BlockingWait{peer, std::chrono::steady_clock::now() + long_after, std::move(abort)};
  if (!recorder_.joinable()) recorder_ = std::thread([this] { record_long_waits(); });
}

void Process::unregister_wait(const void* key, bool completed) {
  bool was_long = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = waiting_.find(key);
    if (it != waiting_.end()) {
      was_long = std::chrono::steady_clock::now() >= it->second.long_at;
      waiting_.erase(it);
    }
    // A failed wait keeps its record: the ranks timing out on this one may still follow it.
    keep_wait_record_ = keep_wait_record_ || !completed;
  }
  // A completed long wait's record goes at once. Only a long wait can have one:
  // waking the recorder after every short wait would cost a thread switch per
  // message, on cores the ranks need.
  if (was_long) recorder_wake_.notify_all();
}

// Note [Naming a stuck rank] for Gloo: its waits are one blocking call, so a
// thread records them. It is the only writer of this rank's record (two
// writers could land out of order and leave a stale one): every 100 ms, or
// when a wait ends, it writes the peer of the oldest long wait, "" when there
// is none, when that changed.
void Process::record_long_waits() {
  std::unique_lock<std::mutex> lock(mutex_);
  int written = -1;  // what the store holds for this rank (-1: no record)
  while (!stopping_) {
    recorder_wake_.wait_for(lock, std::chrono::milliseconds(100));
    if (failure_ || keep_wait_record_) continue;
    const auto now = std::chrono::steady_clock::now();
    int peer = -1;
    auto oldest = std::chrono::steady_clock::time_point::max();
    for (const auto& kv : waiting_) {
      if (now >= kv.second.long_at && kv.second.long_at < oldest) oldest = kv.second.long_at, peer = kv.second.peer;
    }
    if (peer == written) continue;
    written = peer;
    lock.unlock();
    note_waiting(peer);  // not under the lock, which on_failure needs
    lock.lock();
  }
}

int Process::add_failure_listener(std::function<void()> wake) {
  std::lock_guard<std::mutex> lock(mutex_);
  const int id = next_listener_++;
  listeners_[id] = std::move(wake);
  return id;
}

void Process::remove_failure_listener(int id) {
  std::lock_guard<std::mutex> lock(mutex_);
  listeners_.erase(id);
}

// Note [Naming a stuck rank]
// A stuck rank (SIGSTOP, a deadlock, a rank in another collective) keeps its
// connections open: nothing closes, and each rank waiting for it times out on
// its own, possibly naming another waiting rank. The first rank to time out
// reports the peer it waited for under that peer's label, with the reason
// prefixed kStuckReport ("stuck: ", store.h). The store pushes it like a death: every rank's waits
// abort at once naming the stuck rank, and meshrun's summary names it too.
// The peer it waited for may itself be waiting (rank 3 waits for rank 0, which
// waits for the stopped rank 2): a wait that lasts a quarter of the timeout
// (at least 1 s) records "waiting/r<me> = <peer>" in the store (shared memory
// from its wait loop, Gloo from a recorder thread: its waits are one blocking
// call), and the reporter follows that chain to the rank that waits for no one.
std::string Process::describe(const FailureReport& f) {
  const int rank = rank_of_label(f.label);
  if (rank < 0) return str_cat(f.label == "<store>" ? "" : f.label + ": ", f.reason);  // the store host: no rank to name
  if (f.reason.rfind(kStuckReport, 0) == 0) {
    return str_cat("global rank ", rank, " stopped making progress (", f.reason.substr(sizeof kStuckReport - 1), ")");
  }
  if (f.reason.rfind(kUnreachableReport, 0) == 0) {
    return str_cat("global rank ", rank, " became unreachable (", f.reason.substr(sizeof kUnreachableReport - 1), ")");
  }
  return str_cat("global rank ", rank, " died (", f.reason, ")");
}

void Process::raise_failure(const std::string& where, const FailureReport& f) {
  const std::string what = str_cat(where, ": ", describe(f));
  if (f.reason.rfind(kStuckReport, 0) == 0) throw TimeoutError(what);
  throw PeerFailure(what, rank_of_label(f.label));
}

void Process::note_waiting(int peer) {
  try {
    store_->set(config_.group + "/waiting/r" + std::to_string(config_.rank), peer < 0 ? "" : std::to_string(peer));
  } catch (const std::exception&) {  // only a better name for a stuck rank is lost
  }
}

std::pair<int, std::string> Process::end_of_wait_chain(int peer) {
  std::set<int> seen{config_.rank, peer};
  std::string chain;
  while (true) {
    const std::string key = config_.group + "/waiting/r" + std::to_string(peer);
    if (!store_->check(key)) break;
    const std::string next = store_->get(key);
    if (next.empty()) break;
    const int p = std::atoi(next.c_str());
    chain += ", which waits for global rank " + next;
    if (!seen.insert(p).second) break;  // a cycle: they wait for each other
    peer = p;
  }
  return {peer, chain};
}

std::optional<std::string> Process::report_stuck(int peer, const std::string& what) {
  if (failed() || reported_stuck_.exchange(true)) return std::nullopt;  // a failure already named is the cause
  try {
    const auto culprit = end_of_wait_chain(peer);
    store_->report_failure(config_.group + "/r" + std::to_string(culprit.first),
                           str_cat(kStuckReport, "global rank ", config_.rank, " waited in vain for global rank ",
                                   peer, culprit.second, ": ", what));
    return culprit.second;
  } catch (const std::exception&) {  // the store is gone too: the TimeoutError still says it
    return "";
  }
}

void Process::raise_stuck(int peer, const std::string& where, const std::string& what, const std::string& hint) {
  const auto chain = report_stuck(peer, what);
  if (!chain) {  // another rank named the stuck one first: say that
    if (const auto f = failure()) raise_failure(where, *f);
  }
  throw TimeoutError(str_cat(what, chain.value_or(""), "; ", hint));
}

void Process::on_failure(const FailureReport& report) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (failure_) return;
  failure_ = report;
  failed_.store(true, std::memory_order_release);
  for (auto& kv : waiting_) kv.second.abort();
  for (auto& kv : listeners_) kv.second();
}

}  // namespace comm
}  // namespace meshtrain
