#include "process.h"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <set>
#include <thread>

#include "meshtrain/comm.h"
#include "meshtrain/util.h"
#include "util/strings.h"

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
  // A rendezvous wait (the checks below, exchanging addresses or segment
  // names) also ends when a peer dies or stops at start-up. (join() clears
  // this when the constructor throws: the store may outlive this object.)
  store_->set_interrupt([this] {
    if (auto f = failure()) raise_failure("rendezvous", *f);
  });
  // Before hello: a rank refused here must not be reported dead under the label of the rank it collided with.
  const int64_t claims = store_->add(prefix + "claims/r" + std::to_string(config_.rank), 1);
  MESHTRAIN_CHECK(claims == 1, "rank ", config_.rank, " has already joined the store at ", store_->host(), ":",
                  store_->port(), ": another job is using the same MASTER_PORT, or two processes were given RANK=",
                  config_.rank, "; give each job its own port (meshrun --standalone or --master-port 0 picks a free one)");
  store_->hello(prefix + "r" + std::to_string(config_.rank));
  store_->set(prefix + "host/" + std::to_string(config_.rank), config_.host_id);
  check_world_size_like_rank_0();
  if (!store_->authenticated()) check_token_like_rank_0();
}

// Note [Start-up reports]: a rank given another world size than rank 0 would
// wait for ranks that never come, or leave rank 0 waiting for it (both until
// the communication time-out). It stops at once, naming both sizes.
void Process::check_world_size_like_rank_0() {
  const std::string key = config_.group + "/world_size";
  if (config_.rank == 0) return store_->set(key, std::to_string(config_.world_size));
  const std::string rank0 = store_->get(key);
  MESHTRAIN_CHECK(rank0 == std::to_string(config_.world_size), "rank ", config_.rank, " was started with a world ",
                  "size of ", config_.world_size, " (WORLD_SIZE) and rank 0 with ", rank0, ": give every rank the same ",
                  "WORLD_SIZE, the number of ranks in the job");
}

// Note [Token mismatch] (app/launch/launcher.cpp), for ranks: with a store
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
}

void Process::load_hosts() {
  if (!hosts_.empty()) return;
  await_every_rank();
  std::vector<std::string> hosts(config_.world_size);
  for (int r = 0; r < config_.world_size; ++r) {
    hosts[r] = store_->get(config_.group + "/host/" + std::to_string(r));
  }
  hosts_ = std::move(hosts);
}

// The ranks that have not published their host yet, from `from` on: "global
// ranks 1, 3" (the first 8 named).
std::string Process::ranks_not_arrived(int from) {
  std::vector<std::string> missing;
  int more = 0;
  for (int r = from; r < config_.world_size; ++r) {
    if (store_->check(config_.group + "/host/" + std::to_string(r))) continue;
    if (missing.size() < 8) missing.push_back(std::to_string(r));
    else ++more;
  }
  return str_cat(missing.size() + more > 1 ? "global ranks " : "global rank ", meshtrain::join(missing, ", "),
                 more ? str_cat(" and ", more, " more") : "");
}

// Note [Start-up reports]: the rendezvous' first wait, for every rank to say
// its host; where a rank that never comes shows. Rank 0 says whom it waits
// for after 10 s, then every 30 s (a job started by hand has no launcher to
// say it), and the time-out names the missing ranks and what keeps one away.
void Process::await_every_rank() {
  const auto start = std::chrono::steady_clock::now(), deadline = start + config_.timeout;
  auto next_line = start + std::chrono::seconds(10);
  auto backoff = std::chrono::milliseconds(1);
  for (int r = 0; r < config_.world_size;) {
    if (store_->check(config_.group + "/host/" + std::to_string(r))) {
      ++r;
      continue;
    }
    if (auto f = failure()) raise_failure("rendezvous", *f);
    const auto now = std::chrono::steady_clock::now();
    const auto waited = std::chrono::duration_cast<std::chrono::seconds>(now - start).count();
    if (now > deadline) {
      throw TimeoutError(str_cat("rendezvous: ", ranks_not_arrived(r), " did not join the rendezvous store at ",
                                 store_->host(), ":", store_->port(), " within ", waited, " s (the communication ",
                                 "timeout): a rank not started, or started with another MASTER_ADDR, MASTER_PORT or ",
                                 "rendezvous token, never arrives; check every rank's environment", refused("; ")));
    }
    if (config_.rank == 0 && now > next_line) {
      next_line += std::chrono::seconds(30);
      say_waiting(r, waited);
    }
    std::this_thread::sleep_for(backoff);
    backoff = std::min(backoff * 2, std::chrono::milliseconds(20));
  }
}

// Rank 0's waiting line: whom it waits for, where, and what the store refused.
void Process::say_waiting(int from, int64_t waited) {
  const std::string missing = ranks_not_arrived(from);
  const auto limit = std::chrono::duration_cast<std::chrono::seconds>(config_.timeout).count();
  const std::string line =
      str_cat("meshtrain: rank 0 waits for ", missing, " to join the rendezvous store at ", store_->host(), ":",
              store_->port(), " (", waited, " s so far, ", limit, " s at most): ",
              missing.rfind("global ranks", 0) == 0 ? "are they" : "is it", " started, with MASTER_PORT=",
              store_->port(), " and WORLD_SIZE=", config_.world_size, "?", refused(" Meanwhile "), "\n");
  std::fputs(line.c_str(), stderr);
}

// The connections the store refused for their token (Note [Token mismatch]
// in app/launch/launcher.cpp), after `before`; "" when there are none.
std::string Process::refused(const std::string& before) {
  const std::string seen = refusals_seen(*store_);
  return seen.empty() ? "" : str_cat(before, seen, " (a rank with another MESHTRAIN_RDZV_TOKEN is refused so)");
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

// Note [Start-up reports]
// A rank that stops with a ConfigError before its world is made (a bad flag,
// RANK out of range, another WORLD_SIZE, a port already held by another rank
// 0) used to leave the ranks started by hand waiting for it in the rendezvous
// until the communication time-out (300 s by default). So it posts its error
// to the store first, when it can reach the store and prove the token: from
// join() under "<group>/startup/r<rank>" once it has a store connection, else
// from a fresh connection under "<group>/startup" (report_startup_error, for
// errors before any: the environment, the flags, hosting the store), with the
// reason prefixed kStartupReport. Watchers push it like a death, and every
// rank still in its rendezvous ends naming it. A rank whose world is made
// ignores it (and says so once): every rank of its job has arrived, so the
// report comes from a process of another job sharing the port (a second job's
// duplicate rank 0) or an extra process, and must not stop a job that trains.
// Under meshrun the ranks post nothing and meshrun ignores such reports: it
// sees its ranks exit, names the one that failed first and stops the others
// on every node within a second; a report racing it would have the waiting
// ranks exit first and be blamed. What cannot be posted is told by the
// waiting side's time-out instead (await_every_rank): a rank given another
// MASTER_PORT never reaches this store, and one refused for its token proved
// nothing (Note [Token mismatch] in app/launch/launcher.cpp); rank 0 hosting
// the store prints the refusal at once and in its waiting lines.

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
  if (f.reason.rfind(kStartupReport, 0) == 0) {  // Note [Start-up reports]
    const std::string why = f.reason.substr(sizeof kStartupReport - 1);
    return rank < 0 ? str_cat("a process of the job stopped at start-up: ", why)
                    : str_cat("global rank ", rank, " stopped at start-up: ", why);
  }
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

void Process::rendezvous_done() {
  std::lock_guard<std::mutex> lock(mutex_);
  in_rendezvous_ = false;
}

void Process::on_failure(const FailureReport& report) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (failure_) return;
  if (!in_rendezvous_ && report.reason.rfind(kStartupReport, 0) == 0) {  // Note [Start-up reports]
    if (!ignored_startup_report_) {
      std::fputs(str_cat("meshtrain: ignored a start-up report (", describe(report), "): this rank's world was already ",
                         "made, so it comes from another job on the same port or an extra process\n").c_str(),
                 stderr);
    }
    ignored_startup_report_ = true;
    return;
  }
  failure_ = report;
  failed_.store(true, std::memory_order_release);
  for (auto& kv : waiting_) kv.second.abort();
  for (auto& kv : listeners_) kv.second();
}

}  // namespace comm
}  // namespace meshtrain
