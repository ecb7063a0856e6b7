// meshrun's supervisor: spawns the local ranks, prefixes their output, watches
// for failures (local exits and, through the store, other nodes' ranks), stops
// and restarts the group. See launcher.h.

#include "app/launch/launcher.h"

#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <iostream>
#include <memory>
#include <thread>

#include "elastic_rendezvous.h"
#include "rank_processes.h"
#include "comm/store.h"
#include "app/launch/elastic.h"
#include "meshtrain/util.h"
#include "meshtrain/version.h"

extern char** environ;

namespace meshtrain {
namespace launch {

namespace {

using Clock = std::chrono::steady_clock;

int g_signal_pipe[2] = {-1, -1};
volatile sig_atomic_t g_signal = 0;

void on_signal(int sig) {
  g_signal = sig;
  const char b = static_cast<char>(sig);
  if (write(g_signal_pipe[1], &b, 1) < 0) {
  }
}

void say(const std::string& msg) { std::cerr << "meshrun: " << msg << std::endl; }

// Note [Signals while blocked]
// meshrun acts on SIGINT, SIGTERM and SIGHUP where it waits: supervising its
// ranks, polling the store. A call that blocks elsewhere (connecting to a store
// that is not up yet, a store request over a link that went silent) would hold
// the signal for up to --rdzv-timeout or the link time-out, while a scheduler
// that sent SIGTERM expects the job gone within its grace. So a watchdog gives
// the main flow a second to notice the signal (signal_arrived()); past that,
// meshrun says so and exits, and the guard (Note [No orphans]) kills the ranks.
std::atomic<bool> g_signal_seen{false};

// The signal that arrived, 0 if none; the caller acts on it.
int signal_arrived() {
  const int sig = g_signal;
  if (sig) g_signal_seen = true;
  return sig;
}

class SignalWatchdog {
 public:
  SignalWatchdog()
      : thread_([this] {
          Clock::time_point arrived{};
          while (!done_) {
            std::this_thread::sleep_for(std::chrono::milliseconds(50));
            if (!g_signal || g_signal_seen) continue;
            if (arrived == Clock::time_point{}) arrived = Clock::now();
            if (Clock::now() - arrived < std::chrono::seconds(1)) continue;
            const int sig = g_signal;
            say(str_cat("received signal ", strsignal(sig), " while blocked (connecting to the rendezvous store, or "
                        "waiting for its reply); exiting now, the ranks are killed with it"));
            _exit(128 + sig);
          }
        }) {}
  ~SignalWatchdog() {
    done_ = true;
    thread_.join();
  }

 private:
  std::atomic<bool> done_{false};
  std::thread thread_;
};

bool g_quiet = false;  // --quiet
// A progress line (not a failure): --quiet leaves it out.
void inform(const std::string& msg) {
  if (!g_quiet) say(msg);
}

// Note [Token mismatch]
// A node whose meshrun has another rendezvous token than node 0's, or none
// while node 0 has one, is refused by the store and says so itself, naming
// its --rdzv-token-file (or MESHTRAIN_RDZV_TOKEN) and the fix. The nodes
// waiting for it do not stop: the refused process proved nothing, and any
// process that reaches the port can send the same bytes (one 5-byte kDecline
// used to stop every node of a multi-node start within 0.2 s, and the real
// node 1 then failed 31 s later on a store that was gone, naming nothing). So
// the store only records the first few refusals (comm::kRefusalsKey, Note
// [Store authentication] in src/comm/store_protocol.h), and the nodes waiting
// for the others say them as soon as they appear, in each waiting line and in
// the time-out: an operator whose node 1 holds the wrong token reads its
// address there. The opposite case, a node with a token while node 0's store
// takes none, is served; the token's presence is one of the settings nodes
// compare (Note [Nodes agree]), so that difference stops every node at once
// (in a job without a token every client is as trusted as any other).
//
// Note [Nodes agree]
// The flags that shape the job must be the same on every node: the ranks'
// numbering and count (--nproc-per-node, --nnodes, MIN:MAX when elastic), the
// restart policy (--max-restarts: a node that stops restarting leaves the
// others waiting for it), whether there is a token, and meshtrain's version
// (the store's keys and the ranks' checks change between versions). Node 0
// publishes its settings (node_settings) as soon as its store is up; every
// other node reads them before it joins, and one that differs records the
// difference under kNodesDifferKey and refuses itself, naming the flag, both
// values and the fix. The nodes of a fixed-size job waiting for the others in
// their first meeting stop on that record at once (it comes from a node that
// proved the token); an elastic job says it and goes on waiting, since the
// node may come back with the right flags. Before, a node started with
// --nnodes 3 trained with a node 0 of --nnodes 2, and --nproc-per-node 2
// against 1 failed after 304 s asking whether WORLD_SIZE was the same.
constexpr char kNodeSettingsKey[] = "meshrun/settings";  // node 0's node_settings

// Says the store's refusals when they change (Note [Token mismatch]); `said`
// holds what was said last, and then the current ones ("" if none).
void say_new_refusals(comm::TcpStore& store, const std::string& what, std::string& said) {
  const std::string now = comm::refusals_seen(store);
  if (!now.empty() && now != said) {
    say(str_cat("while waiting for ", what, ": ", now, "; not acted on, since it proved no token (if it is a node of "
                "this job, give it node 0's --rdzv-token-file)"));
  }
  if (!now.empty()) said = now;
}

// A wait of the agents until the integer at `key` reaches `target` (their barriers).
struct CountWait {
  std::string key;
  int target = 0;
  std::chrono::milliseconds timeout{0};
  std::string what;            // for messages: "the other nodes"
  bool first_meeting = false;  // a node whose settings differ stops it (Note [Nodes agree])
};

void await_count(comm::TcpStore& store, const CountWait& w) {
  const auto start = Clock::now(), deadline = start + w.timeout;
  auto next_line = start + std::chrono::seconds(5), next_look = start;
  std::string refusals;
  while (store.add(w.key, 0) < w.target) {
    if (signal_arrived()) throw std::runtime_error("interrupted");
    if (w.first_meeting && store.check(kNodesDifferKey)) {  // Note [Nodes agree]
      throw ConfigError(str_cat("meshrun: stopped waiting for ", w.what, ": ", store.get(kNodesDifferKey)));
    }
    if (Clock::now() >= next_look) {  // Note [Token mismatch]: said, never acted on
      next_look += std::chrono::milliseconds(250);
      say_new_refusals(store, w.what, refusals);
    }
    const std::string also = refusals.empty() ? "" : "; meanwhile " + refusals;
    if (Clock::now() > next_line) {  // say that it waits, and for whom
      next_line += std::chrono::seconds(10);
      const auto left = std::chrono::duration_cast<std::chrono::seconds>(deadline - Clock::now()).count();
      inform(str_cat("waiting for ", w.what, ": ", store.add(w.key, 0), " of ", w.target, " nodes so far (", left,
                     " s before giving up; --rdzv-timeout)", also));
    }
    if (Clock::now() > deadline) {
      throw ConfigError(str_cat("meshrun: timed out waiting for ", w.what, " (", store.add(w.key, 0), " of ", w.target,
                                " nodes arrived); start meshrun on every node with the same --nnodes, "
                                "--master-addr, --master-port and --rdzv-token-file", also));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  say_new_refusals(store, w.what, refusals);  // one that came since the last look is said too
}

// Node 0's settings, which it publishes as soon as its store is up (Note [Nodes agree]).
std::string node_0_settings(const LaunchOptions& o, comm::TcpStore& store) {
  const auto patience = std::min<std::chrono::milliseconds>(o.rendezvous_timeout, std::chrono::seconds(10));
  const auto deadline = Clock::now() + patience;
  while (!store.check(kNodeSettingsKey)) {
    MESHTRAIN_CHECK(Clock::now() < deadline, "meshrun: the rendezvous store at ", o.master_addr, ":", store.port(),
                    " holds no settings of node 0's meshrun after ",
                    std::chrono::duration_cast<std::chrono::seconds>(patience).count(), " s: node 0 runs a meshtrain "
                    "older than this node's ", version(), " (or the port is not node 0's meshrun); install the same "
                    "meshtrain version on every node");
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return store.get(kNodeSettingsKey);
}

// Note [Nodes agree]: node 0 publishes its settings; another node compares
// its own with them and, when they differ, says so to the others and refuses itself.
void agree_with_node_0(const LaunchOptions& o, comm::TcpStore& store) {
  const std::string mine = node_settings(o);
  if (o.node_rank == 0) return store.set(kNodeSettingsKey, mine);
  const std::string difference = node_settings_difference(mine, node_0_settings(o, store), o.node_rank);
  if (difference.empty()) return;
  if (!store.check(kNodesDifferKey)) store.set(kNodesDifferKey, difference);
  throw ConfigError("meshrun: " + difference);
}

struct Outcome {
  bool ok = false;
  bool interrupted = false;
  bool regroup = false;  // the ranks stopped at a checkpoint to take a waiting node in
  std::string failure;  // who failed first and how
  bool host_lost = false;   // a rank's host stopped answering (Note [Silent links] in src/comm/socket.h)
  int64_t detected_ns = 0;  // wall clock when the failure was seen (for the next attempt's report)
};

int64_t wall_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// Failures that other nodes report through the store (the FailureWatcher's
// thread), and the rank reported stuck (Note [Naming a stuck rank]).
class RemoteFailures {
 public:
  void record(const comm::FailureReport& r) {
    std::lock_guard<std::mutex> lock(mutex_);
    const bool stuck = r.reason.rfind(comm::kStuckReport, 0) == 0;
    const std::string rank = r.label.substr(r.label.find('/') + 1);  // "r2", "node1"
    const std::string what = stuck ? str_cat("rank ", rank.substr(1), " stopped making progress (",
                                             r.reason.substr(sizeof comm::kStuckReport - 1), ")")
                             : rank.rfind("node", 0) == 0 ? str_cat("node ", rank.substr(4), ": ", r.reason)
                             : r.label == "<store>"       ? r.reason
                                                          : str_cat("a failure was reported for ", r.label, ": ", r.reason);
    if (stuck && stuck_.empty()) stuck_ = what;
    if (r.label == "<store>" && r.reason.find("went silent") != std::string::npos && lost_link_.empty()) {
      lost_link_ = r.reason;
    }
    const bool unreachable = r.reason.rfind(comm::kUnreachableReport, 0) == 0;
    if (!stuck && rank[0] == 'r' && (died_.empty() || (unreachable && !unreachable_))) {
      // A rank behind a silent link comes first: the others' time-outs are its consequence.
      died_rank_ = std::atoi(rank.c_str() + 1);
      died_ = unreachable ? str_cat("rank ", died_rank_, " became unreachable (",
                                    r.reason.substr(sizeof comm::kUnreachableReport - 1), ")")
                          : str_cat("rank ", died_rank_, " died (", r.reason, ")");
      unreachable_ = unreachable;
    }
    if (seen_) return;
    reason_ = what;
    seen_ = true;
  }
  bool seen() const { return seen_; }
  std::string describe() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return reason_;
  }
  // "rank 2 stopped making progress (...)", or "" when no rank was reported stuck.
  std::string stuck() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return stuck_;
  }
  // "rank 2 became unreachable (...)" when the store lost a rank's host, else "".
  std::string unreachable() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return unreachable_ ? died_ : "";
  }
  // "lost the connection to the rendezvous store at ...: the link to ... went silent ..." or "".
  std::string lost_link() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return lost_link_;
  }
  // "rank 2 died (...)" when the store saw a rank other than `rank` die, else "".
  std::string died_other_than(int rank) const {
    std::lock_guard<std::mutex> lock(mutex_);
    return died_rank_ == rank ? "" : died_;
  }

 private:
  std::atomic<bool> seen_{false};
  mutable std::mutex mutex_;
  std::string reason_, stuck_, died_, lost_link_;
  bool unreachable_ = false;
  int died_rank_ = -1;
};

// The failure to name: a rank whose host became unreachable, else this
// node's link to the store gone silent, else the rank reported stuck first,
// when there is one (the ranks that gave up waiting for it exit first; behind a
// cut link, a healthy rank looks stuck).
std::string blame(const std::string& failure, const RemoteFailures& remote) {
  for (const std::string& cause : {remote.unreachable(), remote.lost_link()}) {
    if (!cause.empty()) return failure.rfind(cause, 0) == 0 ? failure : cause + "; first to exit: " + failure;
  }
  const std::string stuck = remote.stuck();
  if (stuck.empty() || failure.rfind(stuck, 0) == 0) return failure;
  return stuck + "; first to exit: " + failure;
}

// The node's --node-rank (in an elastic round node_rank is its place among the members).
int node_id(const LaunchOptions& o) { return o.node_label >= 0 ? o.node_label : o.node_rank; }

// A rank's exit that is not a failure: code 0, or (elastic) stopped at a
// checkpoint for a regroup (Note [Elastic rendezvous]).
bool succeeded(const LaunchOptions& o, int status) {
  return WIFEXITED(status) && (WEXITSTATUS(status) == 0 || (o.elastic && WEXITSTATUS(status) == kRegroupExitCode));
}

// The local rank that failed, described; "" if none. A rank killed by a
// signal comes before ranks that exited with an error: they are usually the
// survivors saying so, reaped in the same sweep (a rank's death reaches the
// others through the store within milliseconds). For the same reason a rank
// of another node that the store saw die comes before a local error exit.
std::string local_failure(const LaunchOptions& o, const std::vector<std::unique_ptr<RankProcess>>& ranks,
                          const RemoteFailures& remote) {
  const RankProcess* failed = nullptr;
  for (const auto& r : ranks) {
    if (!r->exited || succeeded(o, r->status)) continue;
    if (!failed || (WIFSIGNALED(r->status) && !WIFSIGNALED(failed->status))) failed = r.get();
  }
  if (!failed) return "";
  const std::string local = str_cat("rank ", failed->rank, " (node ", node_id(o), ", local rank ",
                                    failed->rank - o.node_rank * o.nproc_per_node, ") failed with ",
                                    describe_status(failed->status));
  const std::string died = WIFSIGNALED(failed->status) ? "" : remote.died_other_than(failed->rank);
  return died.empty() ? local : died + "; first to exit here: " + local;
}

// Watches the local ranks until they all exit (ok), one fails, another node
// reports a failure, or a signal arrives; stops the ranks in the last three cases.
Outcome supervise_local_ranks(const LaunchOptions& o, const std::string& gen, comm::TcpStore& store,
                              std::vector<std::unique_ptr<RankProcess>>& ranks, const comm::FailureWatcher& watcher,
                              RemoteFailures& remote) {
  Outcome outcome;
  Clock::time_point remote_seen{};
  while (!all_exited(ranks)) {
    pump(ranks, std::chrono::milliseconds(50));
    if (signal_arrived()) {
      say(str_cat("received signal ", strsignal(g_signal), "; stopping the ranks"));
      stop_all(ranks, g_signal == SIGINT ? SIGINT : SIGTERM, o.grace);
      outcome.interrupted = true;
      return outcome;
    }
    outcome.failure = local_failure(o, ranks, remote);
    if (outcome.failure.empty() && remote.seen()) {
      // A rank of this node that dies is reported by its store connection as
      // well, often before its exit is reaped: wait a moment for its exit
      // status, which names the rank and the signal.
      if (remote_seen == Clock::time_point()) remote_seen = Clock::now();
      if (Clock::now() - remote_seen > std::chrono::milliseconds(500)) outcome.failure = remote.describe();
    }
    if (outcome.failure.empty()) continue;
    outcome.detected_ns = wall_ns();
    // A link cut one way shows here as peers that went away: name the link.
    const std::string trouble = watcher.link_trouble();
    if (!trouble.empty()) remote.record({"<store>", trouble});
    outcome.failure = blame(outcome.failure, remote);
    say(outcome.failure + "; stopping the other ranks");
    // Other nodes learn of it through the store (a rank's own store connection
    // tells them too, but a rank may die before it connects).
    try {
      store.report_failure(gen + "/node" + std::to_string(node_id(o)), outcome.failure);
    } catch (const std::exception&) {
    }
    stop_all(ranks, SIGTERM, o.grace);
    outcome.failure = blame(outcome.failure, remote);  // a stuck report may arrive while the ranks stop
    return outcome;
  }
  drain(ranks);
  outcome.ok = true;
  for (const auto& r : ranks) outcome.regroup = outcome.regroup || (WIFEXITED(r->status) && WEXITSTATUS(r->status) == kRegroupExitCode);
  return outcome;
}

// Every local rank succeeded; the job is done when every node's ranks are.
Outcome wait_for_every_node(const LaunchOptions& o, const std::string& gen, comm::TcpStore& store,
                            const RemoteFailures& remote) {
  Outcome outcome;
  store.add(gen + "/nodes_done", 1);
  const auto deadline = Clock::now() + std::chrono::hours(24 * 365);
  while (store.add(gen + "/nodes_done", 0) < o.nnodes) {
    // A node that saw every node done leaves at once: its meshrun's exit is
    // not a failure once the count is complete.
    if (remote.seen() && store.add(gen + "/nodes_done", 0) < o.nnodes) {
      outcome.failure = remote.describe();
      return outcome;
    }
    if (signal_arrived() || Clock::now() > deadline) {
      outcome.interrupted = true;
      return outcome;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  outcome.ok = true;
  return outcome;
}

// Node 0 hosts the store: leaving at once could cut off a node that has not
// yet seen the last "done", and it would report the lost store as a failure.
// So every node says it has seen them all, and node 0 waits for that (bounded).
void leave_together(const LaunchOptions& o, const std::string& gen, comm::TcpStore& store) {
  store.add(gen + "/nodes_seen_done", 1);
  if (o.node_rank != 0) return;
  const auto until = Clock::now() + o.rendezvous_timeout;
  while (store.add(gen + "/nodes_seen_done", 0) < o.nnodes && Clock::now() < until && !signal_arrived()) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

// In an elastic round, the other members' meshruns: when one dies (its
// store connection closes, Note [Elastic rendezvous]) the round has failed,
// even if that node's ranks died before they could be missed (in start-up).
std::unique_ptr<comm::FailureWatcher> watch_members(const LaunchOptions& o, int store_port, const std::string& gen,
                                                    const std::vector<NodeEntry>& members, RemoteFailures& remote) {
  return std::make_unique<comm::FailureWatcher>(
      o.master_addr, store_port, kAgentPrefix, o.rendezvous_timeout,
      [&remote, members, gen](const comm::FailureReport& r) {
        const int incarnation = incarnation_of(r.label);
        for (const NodeEntry& m : members) {
          if (m.incarnation == incarnation) {
            remote.record({str_cat(gen, "/node", m.node), "its meshrun is gone (killed, or its machine went down)"});
          }
        }
      },
      o.rdzv_token);
}

// Runs one generation of the group on this node (`members`: of an elastic round, else null).
Outcome run_generation(const LaunchOptions& o, int generation, int store_port, comm::TcpStore& store,
                       const std::map<std::string, std::string>& base_env,
                       const std::vector<NodeEntry>* members = nullptr) {
  const std::string gen = "g" + std::to_string(generation);
  RemoteFailures remote;
  // A start-up report is for ranks started by hand (Note [Start-up reports] in
  // src/comm/process.cpp): this job's ranks post none, meshrun sees them exit.
  comm::FailureWatcher watcher(o.master_addr, store_port, gen + "/", o.rendezvous_timeout,
                               [&](const comm::FailureReport& r) {
                                 if (r.reason.rfind(comm::kStartupReport, 0) != 0) remote.record(r);
                               },
                               o.rdzv_token);
  const auto members_watcher = members ? watch_members(o, store_port, gen, *members, remote) : nullptr;
  std::vector<std::unique_ptr<RankProcess>> ranks;
  const int cores = node_cores();
  for (int local = 0; local < o.nproc_per_node; ++local) {
    auto env = rank_environment(o, local, generation, store_port, cores, base_env);
    ranks.push_back(spawn(o.node_rank * o.nproc_per_node + local, o.command, env, o.prefix_output));
  }
  Outcome outcome = supervise_local_ranks(o, gen, store, ranks, watcher, remote);
  if (outcome.regroup) {
    outcome.ok = false;
    return outcome;
  }
  if (outcome.ok) outcome = wait_for_every_node(o, gen, store, remote);
  outcome.host_lost = !remote.unreachable().empty();
  watcher.stop();
  if (members_watcher) members_watcher->stop();
  if (outcome.ok) leave_together(o, gen, store);
  return outcome;
}

// What every generation of the job on this node shares.
struct Agent {
  LaunchOptions o;
  int port = 0;  // the store's
  comm::TcpStore* store = nullptr;
  std::map<std::string, std::string> base_env;
};

// After a failure, the next attempt reports how long after it it was training again.
void remember_failure_time(Agent& a, const Outcome& outcome) {
  a.base_env["MESHTRAIN_FAILURE_TIME_NS"] = std::to_string(outcome.detected_ns ? outcome.detected_ns : wall_ns());
}

// meshrun's last word on a failed job.
void say_failed(const Outcome& outcome, int max_restarts) {
  say(str_cat("failed: ", outcome.failure, max_restarts > 0 ? str_cat(" (after ", max_restarts, " restarts)") : ""));
}

// A job of a fixed number of nodes: every attempt waits for all of them.
int run_fixed(Agent& a) {
  const LaunchOptions& o = a.o;
  comm::TcpStore& store = *a.store;
  Clock::time_point failed_at{};
  for (int generation = 0;; ++generation) {
    const std::string gen = "g" + std::to_string(generation);
    store.add(gen + "/nodes_joined", 1);
    try {
      await_count(store, {gen + "/nodes_joined", o.nnodes, o.rendezvous_timeout, "the other nodes", generation == 0});
    } catch (const std::runtime_error& e) {
      if (signal_arrived()) return 128 + g_signal;
      say(e.what());
      return 1;
    }
    if (generation > 0) {
      const double s = std::chrono::duration<double>(Clock::now() - failed_at).count();
      inform(str_cat("group restarted (attempt ", generation + 1, "), ", s, " s after the failure was detected"));
    }
    const Outcome outcome = run_generation(o, generation, a.port, store, a.base_env);
    if (outcome.ok) return 0;
    if (outcome.interrupted) return 128 + (g_signal ? g_signal : SIGTERM);
    failed_at = Clock::now();
    remember_failure_time(a, outcome);
    if (outcome.host_lost) {  // its meshrun cannot say it stopped, nor join a restart
      say_failed(outcome, generation);
      say("a job of a fixed number of nodes cannot go on without that host; --nnodes MIN:MAX (elastic) goes on "
          "without it");
      return 1;
    }
    // Every node stops its ranks before anyone restarts. Without a restart to
    // follow, the wait is only so that node 0's store outlives the others'
    // last words: bounded by the grace period, not --rdzv-timeout (a frozen
    // host's meshrun never says it stopped).
    store.add(gen + "/nodes_stopped", 1);
    const bool last = generation >= o.max_restarts;
    const auto stop_wait = last ? o.grace + std::chrono::seconds(5) : o.rendezvous_timeout;
    try {
      await_count(store, {gen + "/nodes_stopped", o.nnodes, stop_wait, "the other nodes to stop"});
    } catch (const std::exception& e) {
      say(last ? str_cat("not every node said it stopped within ", std::chrono::duration_cast<std::chrono::seconds>(
                                                                         stop_wait).count(),
                         " s (", store.add(gen + "/nodes_stopped", 0), " of ", o.nnodes,
                         " did); a node that did not is frozen or cut off: look at it")
               : e.what());
    }
    if (generation >= o.max_restarts) {
      say_failed(outcome, o.max_restarts);
      return 1;
    }
    say(str_cat("restarting the whole group (restart ", generation + 1, " of ", o.max_restarts, ")"));
  }
}

// This node's options and ranks' environment in an elastic round: its group
// rank among the members, and where its ranks look for a waiting node.
std::pair<LaunchOptions, std::map<std::string, std::string>> round_setup(const Agent& a,
                                                                         const ElasticRendezvous::Round& round) {
  LaunchOptions ro = a.o;
  ro.nnodes = static_cast<int>(round.members.size());
  ro.node_rank = round.group_rank;
  ro.node_label = a.o.node_rank;
  std::map<std::string, std::string> env = a.base_env;
  env[kElasticVariable] = "1";
  if (ro.nnodes < a.o.nnodes) env[kRegroupKeyVariable] = round_joined_key(round.round + 1);
  return {ro, env};
}

// meshrun --nnodes MIN:MAX (Note [Elastic rendezvous]): rounds of the nodes
// alive, until the job ends, fails more than --max-restarts times, or has
// fewer than MIN nodes.
int run_elastic(Agent& a) {
  ElasticRendezvous rdzv(a.o, *a.store, inform, [] { return signal_arrived() != 0; });
  int next = rdzv.current_round(), failures = 0;
  while (true) {
    ElasticRendezvous::Round round;
    try {
      round = rdzv.join(next);
    } catch (const ConfigError& e) {
      say(e.what());
      return 2;
    } catch (const std::exception& e) {
      if (signal_arrived()) return 128 + g_signal;
      if (std::string(e.what()) != "finished") {
        say(str_cat("rendezvous failed: ", e.what(), a.o.node_rank == 0 ? "" : "; node 0 hosts the store: an elastic "
                    "job goes on without any other node, not without node 0"));
        return 1;
      }
      inform("the job finished before this node could join");
      return 0;
    }
    const auto setup = round_setup(a, round);
    Outcome outcome = run_generation(setup.first, round.round, a.port, *a.store, setup.second, &round.members);
    next = round.round + 1;
    const auto key = setup.second.find(kRegroupKeyVariable);
    if (outcome.regroup && (key == setup.second.end() || a.store->add(key->second, 0) == 0)) {
      outcome.regroup = false;  // the program's own exit code 75: a failure, not a loop of regroups
      outcome.failure = str_cat("the ranks exited with code ", kRegroupExitCode, " (stopped to take a waiting node "
                                "in), but no node is waiting to join");
    }
    if (outcome.ok) {
      if (a.o.node_rank == 0) rdzv.finish();
      return 0;
    }
    if (outcome.interrupted) return 128 + (g_signal ? g_signal : SIGTERM);
    if (outcome.regroup) {
      inform(str_cat("the ranks stopped at a checkpoint to take a waiting node in; joining round ", next));
      a.base_env.erase("MESHTRAIN_FAILURE_TIME_NS");  // the next round does not follow a failure
      continue;
    }
    remember_failure_time(a, outcome);
    if (++failures > a.o.max_restarts) {
      say_failed(outcome, a.o.max_restarts);
      return 1;
    }
    say(str_cat("meeting the nodes that are left in round ", next, " (restart ", failures, " of ", a.o.max_restarts, ")"));
  }
}

}  // namespace

int run_launcher(const LaunchOptions& options) {
  Agent a;
  a.o = options;
  LaunchOptions& o = a.o;
  g_quiet = o.quiet;
  const std::string token_warning = resolve_rdzv_token(o);
  if (!token_warning.empty()) say(token_warning);
  if (pipe2(g_signal_pipe, O_CLOEXEC | O_NONBLOCK) != 0) return 1;
  supervision().signal_fd = g_signal_pipe[0];
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGHUP, &sa, nullptr);
  signal(SIGPIPE, SIG_IGN);

  OrphanGuard guard;  // See Note [No orphans]
  SignalWatchdog watchdog;  // Note [Signals while blocked]; after the guard, which it relies on
  supervision().guard = &guard;
  struct ForgetGuard {
    ~ForgetGuard() { supervision().guard = nullptr; }
  } forget_guard;
  std::unique_ptr<comm::StoreServer> server;
  a.port = o.master_port;
  if (o.node_rank == 0) {
    server.reset(new comm::StoreServer(o.master_addr, o.master_port, o.rdzv_token));
    a.port = server->port();
  }
  comm::TcpStore store(o.master_addr, a.port, o.rendezvous_timeout, o.rdzv_token, o.rdzv_token_origin);
  agree_with_node_0(o, store);
  a.store = &store;
  a.base_env = process_environment();
  supervision().job_tag = std::to_string(getpid()) + "-" + comm::generate_rdzv_token().substr(0, 16);
  a.base_env["MESHTRAIN_JOB_TAG"] = supervision().job_tag;
  guard.watch_tag(supervision().job_tag);
  if (o.node_rank == 0) {
    inform(o.elastic ? str_cat("elastic job: ", o.nproc_per_node, " ranks per node on ", o.min_nodes, " to ", o.nnodes,
                               " nodes; store at ", o.master_addr, ":", a.port)
                     : str_cat("starting ", o.nnodes * o.nproc_per_node, " ranks (", o.nproc_per_node, " per node x ",
                               o.nnodes, " nodes); store at ", o.master_addr, ":", a.port));
  }
  return o.elastic ? run_elastic(a) : run_fixed(a);
}

}  // namespace launch
}  // namespace meshtrain
