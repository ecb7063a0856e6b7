#pragma once
// meshrun: starts the ranks of a job on this node, torchrun-compatible.
//
//   meshrun --nproc-per-node N [--nnodes M|MIN:MAX --node-rank R --master-addr A
//           --master-port P] [--max-restarts K] -- PROGRAM ARGS...
//
// Node 0's meshrun hosts the rendezvous store at A:P (bound to A only); every
// rank gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK,
// MASTER_ADDR, MASTER_PORT, and OMP_NUM_THREADS / OPENBLAS_NUM_THREADS set to
// its share of the cores. Output lines are prefixed "[rankN]: ". When a rank
// fails, meshrun stops the others on every node (SIGTERM, then SIGKILL after a
// grace period), and either restarts the whole group (--max-restarts) or exits
// non-zero naming the first failed rank. Children die with meshrun (no orphans).

#include <chrono>
#include <map>
#include <string>
#include <vector>

namespace meshtrain {
namespace launch {

struct LaunchOptions {
  int nproc_per_node = 1;
  int nnodes = 1;  // elastic: the most nodes (MAX of --nnodes MIN:MAX)
  // --nnodes MIN:MAX (app/launch/elastic.h): the job goes on
  // with at least min_nodes, and takes lost or new nodes back in up to nnodes.
  bool elastic = false;
  int min_nodes = 1;
  // In an elastic round node_rank is the node's place among the members (its
  // ranks' numbering); this is its --node-rank, for messages (-1: node_rank).
  int node_label = -1;
  std::chrono::milliseconds last_call{std::chrono::seconds(10)};  // --rdzv-last-call
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;  // 0: pick a free port (one node only)
  int max_restarts = 0;
  std::chrono::milliseconds grace{std::chrono::seconds(5)};
  std::chrono::milliseconds rendezvous_timeout{std::chrono::minutes(5)};
  bool prefix_output = true;
  bool quiet = false;        // meshrun's own progress lines off (failures are still said)
  int threads_per_rank = 0;  // 0: the node's cores / nproc_per_node, at least 1
  // The job's rendezvous token (Note [Store authentication]): --rdzv-token-file,
  // else MESHTRAIN_RDZV_TOKEN, else one made for this job on a single node
  // (resolve_rdzv_token); handed to the ranks in their environment.
  std::string rdzv_token_file;
  std::string rdzv_token;
  std::string rdzv_token_origin = "MESHTRAIN_RDZV_TOKEN";  // for messages: "--rdzv-token-file FILE" when from a file
  std::vector<std::string> command;
};

// Parses meshrun's arguments (everything before "--" is ours). Throws
// ConfigError naming the flag and the fix.
LaunchOptions parse_launch_args(const std::vector<std::string>& args);
std::string launch_usage();
// Fills o.rdzv_token (see LaunchOptions). Several nodes with no token given
// run without one: returned as a warning to say ("" otherwise).
std::string resolve_rdzv_token(LaunchOptions& o);
// Whether meshrun's own flags (not the program's) ask for --help / -h.
bool launch_asks_for_help(const std::vector<std::string>& args);

// The environment of one rank, given the process's own environment `base`
// (user settings such as OMP_NUM_THREADS are kept when present).
std::map<std::string, std::string> rank_environment(const LaunchOptions& options, int local_rank,
                                                    int restart, int store_port, int cores,
                                                    const std::map<std::string, std::string>& base);

// What every node's meshrun must share (Note [Nodes agree] in
// app/launch/launcher.cpp): --nnodes (MIN:MAX when elastic), --nproc-per-node,
// --max-restarts, whether it has a rendezvous token, and meshtrain's version,
// as lines "name<TAB>value<TAB>shown" (shown: "--nproc-per-node 2", "a
// rendezvous token (--rdzv-token-file F)"). Pure.
std::string node_settings(const LaunchOptions& options);
// How node `node`'s settings (`mine`) differ from node 0's: one sentence per
// setting, naming both nodes, both values and the fix ("node 1's meshrun has
// --nproc-per-node 1 and node 0's has --nproc-per-node 2: start every node's
// meshrun with the same --nproc-per-node"), joined by "; "; "" when they agree.
// A setting one side does not list (another version) is left to the version's
// sentence. Pure.
std::string node_settings_difference(const std::string& mine, const std::string& node0, int node);

// Runs the job; returns meshrun's exit code.
int run_launcher(const LaunchOptions& options);

}  // namespace launch
}  // namespace meshtrain
