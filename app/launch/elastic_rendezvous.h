#pragma once
// The elastic rendezvous of meshrun's agents (internal; see
// app/launch/elastic.h and Note [Elastic rendezvous]).

#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "comm/store.h"
#include "app/launch/elastic.h"
#include "app/launch/launcher.h"

namespace meshtrain {
namespace launch {

// Where a node whose meshrun settings differ from node 0's records the first
// difference, before it refuses itself (Note [Nodes agree] in launcher.cpp).
constexpr char kNodesDifferKey[] = "meshrun/nodes_differ";

// The store key that counts the nodes joining `round`.
std::string round_joined_key(int round);

// Each meshrun's store connection says hello as "agent/<incarnation>"; the
// prefix to watch, and the incarnation a failure label names.
constexpr char kAgentPrefix[] = "agent/";
int incarnation_of(const std::string& agent_label);

class ElasticRendezvous {
 public:
  struct Round {
    int round = 0;
    std::vector<NodeEntry> members;
    int group_rank = 0;  // this node's index in members
  };
  // Registers this node's meshrun with the store (its connection's liveness
  // is the node's). `inform` says progress lines; `interrupted` is polled
  // while waiting (a signal to meshrun).
  ElasticRendezvous(const LaunchOptions& options, comm::TcpStore& store,
                    std::function<void(const std::string&)> inform, std::function<bool()> interrupted);
  ~ElasticRendezvous();

  // The round a node starting now joins: the open one, or the next when the
  // open one is closed (the job is running without this node).
  int current_round();
  // Joins `round` (or, when this node is left out of it, the next ones) and
  // returns the round this node is a member of. Node 0 closes each round.
  // Throws ConfigError when fewer than MIN nodes arrive within --rdzv-timeout,
  // or when another live meshrun has this --node-rank; std::runtime_error
  // "finished" when the job ends while this node waits.
  Round join(int round);
  // Node 0, when the job has finished: nodes still waiting to join exit.
  void finish();

 private:
  void close_round(int round);
  // The nodes refused so far, for node 0's lines: by the store (a token that
  // is not the job's) and by themselves (settings that differ); "" if none.
  std::string refused_nodes();
  void say_refused_nodes(int round);  // when they changed (refused_)
  bool wait_for_members(int round, std::string& members);
  std::vector<NodeEntry> joined_entries(int round);
  int registered();  // meshruns registered so far (incarnations 1..n)
  int alive_not_joined(const std::vector<NodeEntry>& joined, int* previous_missing);
  void refuse_duplicates(const std::vector<NodeEntry>& joined, const std::set<int>& gone,
                         const std::vector<NodeEntry>& members);
  std::set<int> dead();
  void agent_died(int incarnation);

  const LaunchOptions& o_;
  comm::TcpStore& store_;
  std::function<void(const std::string&)> inform_;
  std::function<bool()> interrupted_;
  int incarnation_ = 0;
  std::vector<NodeEntry> last_members_;  // node 0: the previous round's
  // Node 0: refused_nodes() as last said. Said when it changes and in a
  // time-out, never acted on: the node may come back with the right token or
  // flags (Notes [Token mismatch] and [Nodes agree] in launcher.cpp).
  std::string refused_;
  std::atomic<int> running_round_{-1};   // node 0: the last round it closed
  std::mutex mutex_;
  std::set<int> dead_;
  // Last: its thread writes dead_, so it goes first.
  std::unique_ptr<comm::FailureWatcher> agents_watcher_;  // node 0: which agents died
};

}  // namespace launch
}  // namespace meshtrain
