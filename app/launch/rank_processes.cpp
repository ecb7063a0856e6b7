// meshrun's local ranks as processes (rank_processes.h).

#include "rank_processes.h"

#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <thread>

extern char** environ;

namespace meshtrain {
namespace launch {

namespace {

using Clock = std::chrono::steady_clock;

// Note [No orphans]
// Ranks get PR_SET_PDEATHSIG(SIGKILL), so they die with meshrun even when it is
// SIGKILLed. Their own children (data loaders, shells) do not inherit that, so
// every rank runs in its own process group and a guard process, forked at
// start, holds the read end of a pipe from meshrun: when meshrun dies the pipe
// closes and the guard SIGKILLs every rank's process group. On a normal exit
// meshrun tells the guard "done" first.
// A descendant can leave the rank's group and session (setsid). Every rank's
// environment carries MESHTRAIN_JOB_TAG, unique to this meshrun, which its
// descendants inherit whatever group they move to: meshrun kills the tagged
// processes left when a generation ends, and the guard when meshrun dies.

// The processes whose environment holds MESHTRAIN_JOB_TAG=tag (from /proc).
std::vector<pid_t> tagged_processes(const std::string& tag) {
  const std::string needle = "MESHTRAIN_JOB_TAG=" + tag + std::string(1, '\0');
  std::vector<pid_t> pids;
  DIR* proc = opendir("/proc");
  if (!proc) return pids;
  while (dirent* e = readdir(proc)) {
    const pid_t pid = static_cast<pid_t>(std::atol(e->d_name));
    if (pid <= 0 || pid == getpid()) continue;
    std::ifstream in(std::string("/proc/") + e->d_name + "/environ", std::ios::binary);
    const std::string environ_bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (environ_bytes.rfind(needle, 0) == 0 || environ_bytes.find(std::string(1, '\0') + needle) != std::string::npos)
      pids.push_back(pid);
  }
  closedir(proc);
  return pids;
}

}  // namespace

Supervision& supervision() {
  static Supervision s;
  return s;
}

void Stream::emit(const std::string& prefix, bool flush_partial) {
  size_t start = 0, nl;
  while ((nl = pending.find('\n', start)) != std::string::npos) {
    const std::string line = prefix + pending.substr(start, nl - start + 1);
    if (write(out_fd, line.data(), line.size()) < 0) {
    }
    start = nl + 1;
  }
  pending.erase(0, start);
  if (flush_partial && !pending.empty()) {
    const std::string line = prefix + pending + "\n";
    if (write(out_fd, line.data(), line.size()) < 0) {
    }
    pending.clear();
  }
}

OrphanGuard::OrphanGuard() {
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) return;
  const pid_t pid = fork();
  if (pid == 0) {
    close(fds[1]);
    setsid();  // not in meshrun's group: a signal to that group does not reach the guard
    std::vector<pid_t> groups;
    std::string buf, tag;
    char c;
    while (read(fds[0], &c, 1) == 1) {
      if (c != '\n') {
        buf.push_back(c);
        continue;
      }
      if (buf == "done") _exit(0);
      if (buf.rfind("tag ", 0) == 0) tag = buf.substr(4);
      else groups.push_back(static_cast<pid_t>(std::atol(buf.c_str())));
      buf.clear();
    }
    for (pid_t g : groups) kill(-g, SIGKILL);
    kill_tagged(tag);
    _exit(0);
  }
  close(fds[0]);
  fd_ = fds[1];
  pid_ = pid;
}
OrphanGuard::~OrphanGuard() {
  if (fd_ < 0) return;
  const char done[] = "done\n";
  if (write(fd_, done, sizeof done - 1) < 0) {
  }
  close(fd_);
  waitpid(pid_, nullptr, 0);
}

std::map<std::string, std::string> process_environment() {
  std::map<std::string, std::string> env;
  for (char** e = environ; *e; ++e) {
    const std::string kv = *e;
    const auto eq = kv.find('=');
    if (eq != std::string::npos) env[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  return env;
}

int node_cores() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) == 0) return std::max(1, CPU_COUNT(&set));
  return std::max(1u, std::thread::hardware_concurrency());
}

std::string describe_status(int status) {
  if (WIFEXITED(status)) return "exit code " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return std::string("signal ") + strsignal(WTERMSIG(status));
  return "unknown status";
}


void kill_tagged(const std::string& tag) {
  if (tag.empty()) return;
  for (pid_t pid : tagged_processes(tag)) kill(pid, SIGKILL);
}


std::unique_ptr<RankProcess> spawn(int rank, const std::vector<std::string>& command,
                                   const std::map<std::string, std::string>& env, bool prefix) {
  auto p = std::make_unique<RankProcess>();
  p->rank = rank;
  p->prefix = prefix ? "[rank" + std::to_string(rank) + "]: " : "";
  int out_pipe[2], err_pipe[2];
  if (pipe2(out_pipe, O_CLOEXEC) != 0 || pipe2(err_pipe, O_CLOEXEC) != 0) {
    throw std::runtime_error("meshrun: pipe2 failed");
  }
  std::vector<std::string> env_strings;
  for (const auto& kv : env) env_strings.push_back(kv.first + "=" + kv.second);
  std::vector<char*> argv, envp;
  for (const auto& a : command) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  for (const auto& e : env_strings) envp.push_back(const_cast<char*>(e.c_str()));
  envp.push_back(nullptr);
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid == 0) {
    setpgid(0, 0);                    // its own group: stopping it stops its children too
    prctl(PR_SET_PDEATHSIG, SIGKILL);  // dies with meshrun, even on SIGKILL
    if (getppid() != parent) _exit(1);
    dup2(out_pipe[1], 1);
    dup2(err_pipe[1], 2);
    signal(SIGINT, SIG_DFL);
    signal(SIGTERM, SIG_DFL);
    execvpe(argv[0], argv.data(), envp.data());
    const std::string msg = std::string("meshrun: cannot execute '") + argv[0] + "': " + strerror(errno) + "\n";
    if (write(2, msg.data(), msg.size()) < 0) {
    }
    _exit(127);
  }
  close(out_pipe[1]);
  close(err_pipe[1]);
  p->pid = pid;
  setpgid(pid, pid);
  if (supervision().guard) supervision().guard->watch(pid);
  p->out.fd = out_pipe[0];
  p->out.out_fd = 1;
  p->err.fd = err_pipe[0];
  p->err.out_fd = 2;
  return p;
}

// Drains output and reaps exits for up to `wait`. Returns true when any rank exited.
bool pump(std::vector<std::unique_ptr<RankProcess>>& ranks, std::chrono::milliseconds wait) {
  std::vector<pollfd> fds;
  std::vector<std::pair<RankProcess*, Stream*>> owners;
  fds.push_back({supervision().signal_fd, POLLIN, 0});
  owners.push_back({nullptr, nullptr});
  for (auto& r : ranks) {
    for (Stream* s : {&r->out, &r->err}) {
      if (s->fd >= 0) {
        fds.push_back({s->fd, POLLIN, 0});
        owners.push_back({r.get(), s});
      }
    }
  }
  poll(fds.data(), fds.size(), static_cast<int>(wait.count()));
  char buf[65536];
  for (size_t i = 1; i < fds.size(); ++i) {
    if (!fds[i].revents) continue;
    Stream* s = owners[i].second;
    const ssize_t n = read(s->fd, buf, sizeof buf);
    if (n > 0) {
      s->pending.append(buf, static_cast<size_t>(n));
      s->emit(owners[i].first->prefix, false);
    } else if (n == 0 || (errno != EINTR && errno != EAGAIN)) {
      s->emit(owners[i].first->prefix, true);
      close(s->fd);
      s->fd = -1;
    }
  }
  bool any_exit = false;
  for (auto& r : ranks) {
    if (!r->exited && waitpid(r->pid, &r->status, WNOHANG) == r->pid) {
      r->exited = true;
      any_exit = true;
    }
  }
  return any_exit;
}

bool all_exited(const std::vector<std::unique_ptr<RankProcess>>& ranks) {
  for (auto& r : ranks) if (!r->exited) return false;
  return true;
}

// Forwards what is left in the ranks' pipes, up to end of file. A child the
// rank left behind may hold a pipe open: after 2 s it is killed (its group,
// and every process tagged as this job's), and a pipe still open a second
// later is closed unread.
void drain(std::vector<std::unique_ptr<RankProcess>>& ranks) {
  const auto deadline = Clock::now() + std::chrono::seconds(2);
  bool killed = false;
  while (true) {
    bool open = false;
    for (auto& r : ranks) open = open || r->out.fd >= 0 || r->err.fd >= 0;
    if (!open) break;
    if (!killed && Clock::now() > deadline) {
      for (auto& r : ranks) killpg(r->pid, SIGKILL);
      kill_tagged(supervision().job_tag);
      killed = true;
    }
    if (Clock::now() > deadline + std::chrono::seconds(1)) {
      for (auto& r : ranks) {
        for (Stream* s : {&r->out, &r->err}) {
          if (s->fd >= 0) close(s->fd);
          s->fd = -1;
        }
      }
      break;
    }
    pump(ranks, std::chrono::milliseconds(20));
  }
  kill_tagged(supervision().job_tag);  // what the ranks left running, in whatever group or session
}

// SIGTERM (or `sig`) to every live rank's process group, SIGKILL after the grace period.
void stop_all(std::vector<std::unique_ptr<RankProcess>>& ranks, int sig, std::chrono::milliseconds grace) {
  for (auto& r : ranks) if (!r->exited) killpg(r->pid, sig);
  const auto deadline = Clock::now() + grace;
  while (!all_exited(ranks) && Clock::now() < deadline) pump(ranks, std::chrono::milliseconds(20));
  for (auto& r : ranks) {
    if (!r->exited) {
      killpg(r->pid, SIGKILL);
      waitpid(r->pid, &r->status, 0);
      r->exited = true;
    }
  }
  // Whatever the ranks' own children left behind in their groups goes too.
  for (auto& r : ranks) killpg(r->pid, SIGKILL);
  drain(ranks);
}

}  // namespace launch
}  // namespace meshtrain
