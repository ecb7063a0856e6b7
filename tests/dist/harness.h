#pragma once
// Multi-rank test harness: run_ranks(n, fn) runs fn on n real processes.
//
// The parent (the gtest process) hosts a store on 127.0.0.1, port chosen by the
// kernel (no port races), and starts this test binary n times, filtered to
// this test, with the rank in its environment: forked from a zygote that has
// loaded libtorch but run nothing (Note [Rank zygote], zygote.h), or re-executed
// (or, for the MPI backend, by mpirun: Note [Ranks under mpirun]).
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
// Note [Ranks under mpirun]
// When RankOptions::env holds MESHTRAIN_BACKEND=mpi, the parent starts one
// `mpirun --allow-run-as-root --oversubscribe --bind-to none -np N --mca btl
// self,vader -x ...` re-executing this binary filtered to the test, with the
// same time limit; each rank takes its rank from OMPI_COMM_WORLD_RANK, joins
// the MPI world (init_from_env), writes its output to its own log, and records
// its outcome in the run's directory before it leaves: mpirun reports only the
// whole job's status, and ends the job as soon as one rank fails. No store, no
// zygote (mpirun starts its ranks itself). Under mpirun a dead rank ends the
// whole job, so `may_die` there means: the rank may end without recording an
// outcome, and mpirun may fail the job; the other ranks must still pass.
//
// Because every rank process reruns the test body from its start, code before
// a run_ranks call must take the same path in the parent and in the ranks: do
// not return early on in_rank_process() before a later run_ranks call; pass
// data from the parent to a later call's ranks through RankOptions::env.

#include <chrono>
#include <functional>
#include <set>
#include <string>
#include <vector>

#include "meshtrain/comm.h"

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
  // the harness kills any of them still alive once the others have exited
  // (under mpirun, see Note [Ranks under mpirun]).
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
  explicit RankRun(std::string dir, int launcher_status = -1, std::chrono::system_clock::time_point ended = {})
      : dir_(std::move(dir)), launcher_status_(launcher_status), ended_(ended) {}
  ~RankRun();
  RankRun(RankRun&& other) noexcept
      : dir_(std::move(other.dir_)), launcher_status_(other.launcher_status_), ended_(other.ended_) {
    other.dir_.clear();
  }
  const std::string& dir() const { return dir_; }
  std::string file(const std::string& name) const { return dir_ + "/" + name; }
  // Under mpirun: mpirun's wait status (waitpid's), and when it had exited. -1 otherwise.
  int launcher_status() const { return launcher_status_; }
  std::chrono::system_clock::time_point ended() const { return ended_; }

 private:
  std::string dir_;
  int launcher_status_;
  std::chrono::system_clock::time_point ended_;
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
