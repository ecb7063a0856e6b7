// Note [Elastic rendezvous]
// meshrun --nnodes MIN:MAX runs the job in rounds, all keyed in the store that
// node 0's meshrun hosts (node 0 must stay: torchrun's c10d rendezvous has
// the same single host):
//   rdzv/agents            registrations so far; a meshrun's registration
//                          number k is its incarnation, its store connection
//                          says hello("agent/k"), so node 0 learns within
//                          milliseconds when a node's meshrun dies
//   rdzv/round             the round node 0 has opened
//   rdzv/rR/inc/K          the node rank of incarnation K, which joined round R
//   rdzv/rR/joined         how many joined round R and are alive (a counter;
//                          node 0 takes back a waiting node that dies)
//   rdzv/rR/members        written by node 0 when it closes round R
//   rdzv/refused/K         incarnation K has a --node-rank a member has
//   rdzv/finished          the job is done: nodes still waiting exit
// Node 0 closes a round when MAX nodes joined (and none of the previous
// round's members is still on its way: a running node is not pushed out by
// newcomers), or at least MIN and either the last call (--rdzv-last-call) has
// passed or, after the first round, every live registered node has joined
// (the survivors of a loss meet at once, without waiting out the window). Round R's ranks run as generation R: the
// store keys of their communicators are namespaced by it.
// A node that arrives while round R runs joins round R+1 and waits. If round R
// has fewer than MAX members its ranks are told where to look
// (MESHTRAIN_REGROUP_KEY = rdzv/r(R+1)/joined): meshtrain checks it at each
// checkpoint and stops with exit code 75 when a node waits, and every member
// meets in round R+1 with the newcomer. A loss is a failure (it counts against
// --max-restarts); taking a node in is not.

#include "elastic_rendezvous.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <thread>

#include "meshtrain/comm.h"
#include "meshtrain/util.h"
#include "util/strings.h"

namespace meshtrain {
namespace launch {

namespace {

using Clock = std::chrono::steady_clock;

std::string round_key(int round, const std::string& what) { return str_cat("rdzv/r", round, "/", what); }

constexpr char kFinishedKey[] = "rdzv/finished";
constexpr char kAgentsKey[] = "rdzv/agents";
constexpr char kRoundKey[] = "rdzv/round";

int parse_count(const std::string& text, const std::string& what) {
  char* end = nullptr;
  const long v = std::strtol(text.c_str(), &end, 10);
  MESHTRAIN_CHECK(!text.empty() && end && *end == '\0' && v >= 0 && v < (1L << 30), "meshrun: malformed ", what,
                  " '", text, "' in the rendezvous store");
  return static_cast<int>(v);
}

std::string node_list(const std::vector<NodeEntry>& members) {
  std::vector<std::string> ids;
  for (const NodeEntry& m : members) ids.push_back(std::to_string(m.node));
  return meshtrain::join(ids, ", ");
}

// " (without node 1)", " (node 2 joined)": how `now` differs from the previous round's members.
std::string membership_change(const std::vector<NodeEntry>& before, const std::vector<NodeEntry>& now) {
  auto ids_not_in = [](const std::vector<NodeEntry>& a, const std::vector<NodeEntry>& b) {
    std::vector<NodeEntry> out;
    for (const NodeEntry& e : a) {
      if (std::none_of(b.begin(), b.end(), [&e](const NodeEntry& x) { return x.node == e.node; })) out.push_back(e);
    }
    return out;
  };
  const std::vector<NodeEntry> lost = ids_not_in(before, now), added = ids_not_in(now, before);
  std::vector<std::string> parts;
  if (!lost.empty()) parts.push_back(str_cat("without node", lost.size() > 1 ? "s " : " ", node_list(lost)));
  if (!added.empty()) parts.push_back(str_cat("node", added.size() > 1 ? "s " : " ", node_list(added), " joined"));
  return parts.empty() ? "" : " (" + meshtrain::join(parts, "; ") + ")";
}

}  // namespace

bool round_can_close(const RoundState& s, int min_nodes, int max_nodes, double last_call_seconds) {
  if (s.joined >= max_nodes && s.previous_missing == 0) return true;
  if (s.joined < min_nodes) return false;
  if (s.elapsed_seconds >= last_call_seconds) return true;
  return !s.first_round && s.alive_not_joined == 0;
}

std::vector<NodeEntry> choose_members(const std::vector<NodeEntry>& joined, const std::set<int>& dead, int max_nodes,
                                      const std::vector<NodeEntry>& previous) {
  std::vector<NodeEntry> members;
  std::set<int> seen;
  auto was_member = [&previous](const NodeEntry& e) {
    return std::any_of(previous.begin(), previous.end(), [&e](const NodeEntry& p) { return p.node == e.node; });
  };
  // Node 0 first (it hosts the store and closes the rounds, so it is always
  // in), then the nodes already training, then newcomers.
  for (const int pass : {0, 1, 2}) {
    for (const NodeEntry& e : joined) {
      const int priority = e.node == 0 ? 0 : was_member(e) ? 1 : 2;
      if (priority != pass || dead.count(e.incarnation) || seen.count(e.node)) continue;
      if (static_cast<int>(members.size()) >= max_nodes) break;
      members.push_back(e);
      seen.insert(e.node);
    }
  }
  std::sort(members.begin(), members.end(), [](const NodeEntry& a, const NodeEntry& b) { return a.node < b.node; });
  return members;
}

std::string encode_members(const std::vector<NodeEntry>& members) {
  std::vector<std::string> parts;
  for (const NodeEntry& m : members) parts.push_back(str_cat(m.node, "#", m.incarnation));
  return meshtrain::join(parts, ",");
}

std::vector<NodeEntry> decode_members(const std::string& text) {
  std::vector<NodeEntry> members;
  for (const std::string& part : split(text, ',')) {
    const auto hash = part.find('#');
    MESHTRAIN_CHECK(hash != std::string::npos, "meshrun: malformed member '", part, "' in the rendezvous store");
    members.push_back({parse_count(part.substr(0, hash), "node rank"), parse_count(part.substr(hash + 1), "incarnation")});
  }
  return members;
}

std::string round_joined_key(int round) { return round_key(round, "joined"); }

int incarnation_of(const std::string& agent_label) { return std::atoi(agent_label.c_str() + sizeof kAgentPrefix - 1); }

ElasticRendezvous::ElasticRendezvous(const LaunchOptions& o, comm::TcpStore& store,
                                     std::function<void(const std::string&)> inform,
                                     std::function<bool()> interrupted)
    : o_(o), store_(store), inform_(std::move(inform)), interrupted_(std::move(interrupted)) {
  if (o.node_rank == 0) {
    agents_watcher_ = std::make_unique<comm::FailureWatcher>(
        o.master_addr, store.port(), kAgentPrefix, o.rendezvous_timeout,
        [this](const comm::FailureReport& r) { agent_died(incarnation_of(r.label)); },
        o.rdzv_token);
  }
  incarnation_ = static_cast<int>(store.add(kAgentsKey, 1));
  store.hello(str_cat(kAgentPrefix, incarnation_));
}

ElasticRendezvous::~ElasticRendezvous() {
  agents_watcher_.reset();  // its thread writes dead_: joined before the members go
}

// Node 0's watcher thread. A node that died while waiting for the next round
// no longer counts as waiting: the running ranks would stop for nothing.
void ElasticRendezvous::agent_died(int incarnation) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    dead_.insert(incarnation);
  }
  const int next = running_round_.load() + 1;
  try {
    if (next > 0 && store_.check(round_key(next, str_cat("inc/", incarnation)))) store_.add(round_joined_key(next), -1);
  } catch (const std::exception&) {  // the store is going away with the job
  }
}

std::set<int> ElasticRendezvous::dead() {
  std::lock_guard<std::mutex> lock(mutex_);
  return dead_;
}

int ElasticRendezvous::current_round() {
  return store_.check(kRoundKey) ? parse_count(store_.get(kRoundKey), "round") : 0;
}

ElasticRendezvous::Round ElasticRendezvous::join(int round) {
  for (int r = round;; ++r) {
    // The entry first, then the count: a node that dies between the two is
    // only missing from the count (which tells running ranks a node waits).
    store_.set(round_key(r, str_cat("inc/", incarnation_)), std::to_string(o_.node_rank));
    store_.add(round_joined_key(r), 1);
    if (o_.node_rank == 0) close_round(r);
    std::string text;
    if (!wait_for_members(r, text)) throw std::runtime_error("finished");
    const std::vector<NodeEntry> members = decode_members(text);
    for (size_t i = 0; i < members.size(); ++i) {
      if (members[i] == NodeEntry{o_.node_rank, incarnation_}) return Round{r, members, static_cast<int>(i)};
    }
    const std::string refused = str_cat("rdzv/refused/", incarnation_);
    MESHTRAIN_CHECK(!store_.check(refused), store_.get(refused));
    // Left out: the round closed before this node arrived (or this node's
    // previous meshrun is still listed in it): the next round.
    inform_(static_cast<int>(members.size()) < o_.nnodes
                ? str_cat("the job is running on nodes ", node_list(members), " (round ", r, "); this node ",
                          o_.node_rank, " joins at the job's next checkpoint")
                : str_cat("the job is running on its maximum of ", o_.nnodes, " nodes; node ", o_.node_rank,
                          " waits for a place"));
  }
}

// Node 0: waits until the round may close (round_can_close), then fixes its members.
void ElasticRendezvous::close_round(int round) {
  store_.set(kRoundKey, std::to_string(round));
  const auto start = Clock::now();
  auto next_line = start + std::chrono::seconds(5);
  auto next_look = start;
  while (true) {
    if (interrupted_()) throw std::runtime_error("interrupted");
    if (Clock::now() >= next_look) {
      next_look += std::chrono::milliseconds(250);
      say_refused_nodes(round);
    }
    const std::vector<NodeEntry> entries = joined_entries(round);
    const std::set<int> gone = dead();
    const std::vector<NodeEntry> members = choose_members(entries, gone, o_.nnodes, last_members_);
    RoundState state;
    state.joined = static_cast<int>(members.size());
    state.alive_not_joined = alive_not_joined(entries, &state.previous_missing);
    state.elapsed_seconds = std::chrono::duration<double>(Clock::now() - start).count();
    state.first_round = round == 0;
    if (round_can_close(state, o_.min_nodes, o_.nnodes, std::chrono::duration<double>(o_.last_call).count())) {
      say_refused_nodes(round);  // one that came since the last look is said too
      refuse_duplicates(entries, gone, members);
      store_.set(round_key(round, "members"), encode_members(members));
      inform_(str_cat("round ", round, ": nodes ", node_list(members), ", ",
                      members.size() * static_cast<size_t>(o_.nproc_per_node), " ranks",
                      round > 0 ? membership_change(last_members_, members) : ""));
      last_members_ = members;
      running_round_.store(round);
      return;
    }
    MESHTRAIN_CHECK(Clock::now() - start < o_.rendezvous_timeout, "meshrun: timed out in round ", round,
                    " waiting for --nnodes ", o_.min_nodes, ":", o_.nnodes, " (", state.joined, " of at least ",
                    o_.min_nodes, " nodes joined); start meshrun on more nodes or lower MIN",
                    refused_.empty() ? "" : "; meanwhile " + refused_);
    if (Clock::now() > next_line) {
      next_line += std::chrono::seconds(10);
      inform_(str_cat("round ", round, ": ", state.joined, " nodes so far, waiting for ", o_.min_nodes, " to ",
                      o_.nnodes, " (--rdzv-last-call, --rdzv-timeout)"));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

void ElasticRendezvous::say_refused_nodes(int round) {
  const std::string now = refused_nodes();
  if (now != refused_) inform_(str_cat("round ", round, ": ", now));
  refused_ = now;
}

std::string ElasticRendezvous::refused_nodes() {
  std::vector<std::string> parts;
  const std::string by_store = comm::refusals_seen(store_);
  if (!by_store.empty()) parts.push_back(by_store);
  if (store_.check(kNodesDifferKey)) parts.push_back("a node refused itself: " + store_.get(kNodesDifferKey));
  return meshtrain::join(parts, "; ");
}

// The nodes that joined `round`, in registration order (a node's entry is
// keyed by its incarnation: one that died half-way hides no one).
std::vector<NodeEntry> ElasticRendezvous::joined_entries(int round) {
  std::vector<NodeEntry> entries;
  for (int k = 1, n = registered(); k <= n; ++k) {
    const std::string key = round_key(round, str_cat("inc/", k));
    if (store_.check(key)) entries.push_back({parse_count(store_.get(key), "node rank"), k});
  }
  return entries;
}

int ElasticRendezvous::registered() { return static_cast<int>(store_.add(kAgentsKey, 0)); }

// Live registered nodes not in `joined`; `previous_missing`: how many of them were members of the previous round.
int ElasticRendezvous::alive_not_joined(const std::vector<NodeEntry>& joined, int* previous_missing) {
  const std::set<int> gone = dead();
  int waiting = 0;
  *previous_missing = 0;
  for (int k = 1, n = registered(); k <= n; ++k) {
    const bool in = std::any_of(joined.begin(), joined.end(), [k](const NodeEntry& e) { return e.incarnation == k; });
    if (in || gone.count(k)) continue;
    ++waiting;
    *previous_missing += std::any_of(last_members_.begin(), last_members_.end(),
                                     [k](const NodeEntry& m) { return m.incarnation == k; });
  }
  return waiting;
}

// A live node whose --node-rank a member already has is told so (it would wait for ever).
void ElasticRendezvous::refuse_duplicates(const std::vector<NodeEntry>& joined, const std::set<int>& gone,
                                          const std::vector<NodeEntry>& members) {
  for (const NodeEntry& e : joined) {
    for (const NodeEntry& m : members) {
      if (m.node == e.node && m.incarnation != e.incarnation && !gone.count(e.incarnation)) {
        store_.set(str_cat("rdzv/refused/", e.incarnation),
                   str_cat("meshrun: another meshrun is running as --node-rank ", e.node,
                           " in this job; give every node its own --node-rank"));
      }
    }
  }
}

bool ElasticRendezvous::wait_for_members(int round, std::string& members) {
  const std::string key = round_key(round, "members");
  while (!store_.check(key)) {
    if (interrupted_()) throw std::runtime_error("interrupted");
    if (store_.check(kFinishedKey)) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  members = store_.get(key);
  return true;
}

// The nodes still waiting poll for this; node 0 hosts the store, so it stays
// until they have seen it and left (bounded): leaving at once would make their
// next poll a lost store, and their exit a failure.
void ElasticRendezvous::finish() {
  store_.set(kFinishedKey, "1");
  const auto until = Clock::now() + std::chrono::seconds(3);
  while (Clock::now() < until) {
    if (static_cast<int>(dead().size()) >= registered() - 1) return;  // everyone but node 0 has gone
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

bool node_waiting_to_join() {
  const char* key = std::getenv(kRegroupKeyVariable);
  if (!key || !*key) return false;
  const comm::DistEnv env = comm::dist_env_from_process();  // the store meshrun told this rank
  comm::TcpStore store(env.master_addr, env.master_port, std::chrono::seconds(30));
  return store.add(key, 0) > 0;
}

}  // namespace launch
}  // namespace meshtrain
