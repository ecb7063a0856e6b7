#pragma once
// Multi-rank test harness: run_ranks(n, fn) runs fn on n real processes.
//
// The parent (the gtest process) hosts a store on 127.0.0.1, port chosen by the
// kernel (no port races), and starts this test binary n times, filtered to
// this test, with the rank in its environment: forked from a zygote that has
// loaded libtorch but run nothing (Note [Rank zygote], zygote.h), or re-executed.
// It never forks itself after running libtorch code, because libgomp's threads
// do not survive a fork. In each child the same test body runs again; run_ranks finds
// the rank in the environment, joins the group, runs fn(comm) and exits.
// The parent waits with a time limit and fails the test naming every rank that
// failed, crashed or timed out, with that rank's output. A rank that fails to
// initialize fails the test; nothing is ever skipped.
//
// A rank that fails (an assertion or an exception) reports itself to the store
// so the other ranks stop at once with PeerFailure instead of waiting for it.
//
// Because every rank process reruns the test body from its start, code before
// a run_ranks call must take the same path in the parent and in the ranks: do
// not return early on in_rank_process() before a later run_ranks call; pass
// data from the parent to a later call's ranks through RankOptions::env.

#include <chrono>
#include <functional>
#include <set>

#include "meshtrain/comm/communicator.h"

namespace meshtrain {
namespace testing {

struct RankOptions {
  // Wall-clock limit for the whole group.
  std::chrono::seconds time_limit{120};
  // The communicator's own timeout for blocking waits.
  std::chrono::milliseconds comm_timeout{std::chrono::seconds(30)};
  bool verify = true;
  // CommOptions::inline_bytes; -1 keeps the communicator's default. 0 sends
  // every payload by the ring algorithms, however small.
  int64_t inline_bytes = -1;
  // Ranks that may end by a signal (a test that kills or stops them on purpose);
  // the harness kills any of them still alive once the others have exited.
  std::set<int> may_die;
  // Extra environment for the ranks ("NAME=value").
  std::vector<std::string> env;
  // Pretend the ranks run on this many hosts (MESHTRAIN_HOST_ID), in
  // contiguous blocks: with 4 ranks and 2 hosts, ranks 0-1 and 2-3 share one.
  int hosts = 1;
};

// A directory shared by the parent and the ranks of one run_ranks call: ranks
// write results there (shared_dir() inside a rank) and the parent reads them.
class RankRun {
 public:
  explicit RankRun(std::string dir) : dir_(std::move(dir)) {}
  ~RankRun();
  RankRun(RankRun&& other) noexcept : dir_(std::move(other.dir_)) { other.dir_.clear(); }
  const std::string& dir() const { return dir_; }
  std::string file(const std::string& name) const { return dir_ + "/" + name; }

 private:
  std::string dir_;
};

// Runs fn on world_size processes; fn receives the world communicator.
RankRun run_ranks(int world_size, const std::function<void(comm::Communicator&)>& fn,
                  const RankOptions& options = RankOptions());

// True inside a rank process.
bool in_rank_process();
// Inside a rank: the directory of its run_ranks call (see RankRun).
std::string shared_dir();

}  // namespace testing
}  // namespace meshtrain
