#pragma once
// meshrun's local ranks as processes: spawned in groups of their own, their
// output forwarded line by line with a prefix, their exits reaped, and
// nothing they started left behind (Note [No orphans] in rank_processes.cpp).
// The supervisor (launcher.cpp) decides when to start, stop and restart them.

#include <sys/types.h>

#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace meshtrain {
namespace launch {

// One output stream of one rank, re-emitted line by line with a prefix.
struct Stream {
  int fd = -1;
  int out_fd = 1;
  std::string pending;
  // Writes the complete lines received (and with flush_partial the rest), each after `prefix`.
  void emit(const std::string& prefix, bool flush_partial);

};

class OrphanGuard {
 public:
  OrphanGuard();  // forks the guard process
  ~OrphanGuard();  // tells it "done" and reaps it
  void watch(pid_t group) { tell(std::to_string(group)); }
  void watch_tag(const std::string& tag) { tell("tag " + tag); }

 private:
  void tell(const std::string& what) {
    const std::string line = what + "\n";
    if (fd_ >= 0 && write(fd_, line.data(), line.size()) < 0) {
    }
  }

 private:
  int fd_ = -1;
  pid_t pid_ = -1;
};

struct RankProcess {
  int rank = 0;
  pid_t pid = -1;
  bool exited = false;
  int status = 0;
  Stream out, err;
  std::string prefix;
};

// What every call below shares with the supervisor: the read end of its
// signal pipe (a wait wakes on a signal), the orphan guard of the job (when
// one runs) and the job's tag (MESHTRAIN_JOB_TAG).
struct Supervision {
  int signal_fd = -1;
  OrphanGuard* guard = nullptr;
  std::string job_tag;
};
Supervision& supervision();

// This process's environment, as the ranks' starting point.
std::map<std::string, std::string> process_environment();
// The cores this process may run on.
int node_cores();
// "exit code 3", "signal Killed".
std::string describe_status(int status);
// SIGKILL to every process whose environment carries MESHTRAIN_JOB_TAG=tag.
void kill_tagged(const std::string& tag);

// Starts `command` as rank `rank` with environment `env`, in a process group
// of its own; its output prefixed "[rankN]: " when `prefix`.
std::unique_ptr<RankProcess> spawn(int rank, const std::vector<std::string>& command,
                                   const std::map<std::string, std::string>& env, bool prefix);
// Drains output and reaps exits for up to `wait`. Returns true when any rank exited.
bool pump(std::vector<std::unique_ptr<RankProcess>>& ranks, std::chrono::milliseconds wait);
bool all_exited(const std::vector<std::unique_ptr<RankProcess>>& ranks);
// Forwards what is left in the ranks' pipes, up to end of file (a child a
// rank left behind that holds a pipe open is killed after 2 s).
void drain(std::vector<std::unique_ptr<RankProcess>>& ranks);
// `sig` to every live rank's process group, SIGKILL after `grace`.
void stop_all(std::vector<std::unique_ptr<RankProcess>>& ranks, int sig, std::chrono::milliseconds grace);

}  // namespace launch
}  // namespace meshtrain
