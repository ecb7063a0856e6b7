#pragma once
// Elastic runs: `meshrun --nnodes MIN:MAX`. See Note [Elastic rendezvous] in
// app/launch/elastic_rendezvous.cpp.
//
// The job runs in rounds. In each round the nodes whose meshrun is alive meet
// in the store; node 0 (it hosts the store, so it must stay) closes the round
// and fixes its members, who run the ranks on (members x nproc-per-node) ranks.
// When a member is lost, the others stop their ranks and meet in the next round
// without it. A node that arrives while a round runs waits; if the job has
// fewer than MAX nodes the ranks stop at their next checkpoint (exit code
// kRegroupExitCode, not a failure) and the next round takes the new node in.
// The program picks a layout for each world size and resumes from its last
// checkpoint (meshtrain: --elastic-layouts, else its flags, else the planner).

#include <set>
#include <string>
#include <vector>

namespace meshtrain {
namespace launch {

// A rank's exit code that means "stopped at a checkpoint so that meshrun can
// take a waiting node in" (EX_TEMPFAIL of sysexits.h: try again).
constexpr int kRegroupExitCode = 75;
// Set in the ranks' environment under an elastic meshrun whose job has fewer
// than MAX nodes: the store key that counts nodes waiting to join.
constexpr char kRegroupKeyVariable[] = "MESHTRAIN_REGROUP_KEY";
// Set to 1 in the ranks' environment under an elastic meshrun.
constexpr char kElasticVariable[] = "MESHTRAIN_ELASTIC";

// For a rank (any rank may ask; meshtrain asks on rank 0 and tells the
// others): whether a node is waiting to join this job, from the job's store.
// false outside an elastic meshrun, or when the job already has MAX nodes.
bool node_waiting_to_join();

// One node's meshrun in a round: its --node-rank and its registration number
// in the store (a node that comes back after a loss is a new incarnation).
struct NodeEntry {
  int node = 0;
  int incarnation = 0;
  bool operator==(const NodeEntry& o) const { return node == o.node && incarnation == o.incarnation; }
};

// What node 0 knows while a round is open.
struct RoundState {
  int joined = 0;            // live nodes that joined this round (at most MAX counted)
  int alive_not_joined = 0;  // live nodes registered with the store that have not joined it yet
  int previous_missing = 0;  // of those, members of the previous round (still stopping their ranks)
  double elapsed_seconds = 0;
  bool first_round = true;   // no node can be expected yet: wait for MAX or the last call
};

// Whether node 0 may close the round: MAX nodes joined and no member of the
// previous round still on its way (newcomers do not push it out); or at least
// MIN and either the last-call window has passed or (after the first round)
// every live node has joined. Pure.
bool round_can_close(const RoundState& state, int min_nodes, int max_nodes, double last_call_seconds);

// The members of a round from its joins in arrival order: dead incarnations
// dropped, a node id kept once, at most `max_nodes`, chosen in this order:
// node 0, the previous round's members, then the others by arrival; ordered by
// node id (the order gives each its group rank). Pure.
std::vector<NodeEntry> choose_members(const std::vector<NodeEntry>& joined, const std::set<int>& dead_incarnations,
                                      int max_nodes, const std::vector<NodeEntry>& previous = {});

// "0#1,1#4" and back. decode throws ConfigError on a malformed list.
std::string encode_members(const std::vector<NodeEntry>& members);
std::vector<NodeEntry> decode_members(const std::string& text);

}  // namespace launch
}  // namespace meshtrain
