// The rank zygote: see Note [Rank zygote] in zygote.h.

#include "zygote.h"

#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <set>

extern char** environ;

namespace meshtrain {
namespace testing {

namespace {

// ---- the protocol, over one socket pair (send with MSG_NOSIGNAL: a dead peer
// is an error, not a SIGPIPE): a request is a count, then that many
// length-prefixed strings (the test, the log path, the environment); the
// answer is one int32.

bool write_all(int fd, const void* data, size_t n) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
    if (w <= 0) return false;
    p += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}

bool read_all(int fd, void* data, size_t n) {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    const ssize_t r = read(fd, p, n);
    if (r <= 0) return false;
    p += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

bool write_strings(int fd, const std::vector<std::string>& strings) {
  const uint32_t count = static_cast<uint32_t>(strings.size());
  if (!write_all(fd, &count, sizeof count)) return false;
  for (const auto& s : strings) {
    const uint32_t len = static_cast<uint32_t>(s.size());
    if (!write_all(fd, &len, sizeof len) || !write_all(fd, s.data(), s.size())) return false;
  }
  return true;
}

bool read_strings(int fd, std::vector<std::string>& strings) {
  uint32_t count = 0;
  if (!read_all(fd, &count, sizeof count)) return false;
  strings.assign(count, "");
  for (auto& s : strings) {
    uint32_t len = 0;
    if (!read_all(fd, &len, sizeof len)) return false;
    s.resize(len);
    if (len > 0 && !read_all(fd, &s[0], len)) return false;
  }
  return true;
}

// Reads one int32 within `timeout_ms`; false on timeout or a closed pipe.
bool read_answer(int fd, int32_t& value, int timeout_ms) {
  pollfd p{fd, POLLIN, 0};
  if (poll(&p, 1, timeout_ms) != 1) return false;
  return read_all(fd, &value, sizeof value);
}

int thread_count() {
  DIR* d = opendir("/proc/self/task");
  if (!d) return -1;
  int n = 0;
  while (dirent* e = readdir(d))
    if (e->d_name[0] != '.') ++n;
  closedir(d);
  return n;
}

// fork + exec of `path` with `args` and exactly `environment`; output to
// `log_path` (empty: inherited). The child dies with this process.
pid_t fork_exec(const std::string& path, const std::vector<std::string>& args,
                const std::vector<std::string>& environment, const std::string& log_path) {
  std::vector<char*> argv, envp;
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  for (const auto& e : environment) envp.push_back(const_cast<char*>(e.c_str()));
  envp.push_back(nullptr);
  const pid_t pid = fork();
  if (pid == 0) {
    // Only async-signal-safe calls until exec.
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (!log_path.empty()) {
      const int fd = open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      if (fd >= 0) {
        dup2(fd, 1);
        dup2(fd, 2);
      }
    }
    execve(path.c_str(), argv.data(), envp.data());
    _exit(127);
  }
  return pid;
}

pid_t fork_exec_self(const std::vector<std::string>& args, const std::vector<std::string>& environment,
                     const std::string& log_path) {
  return fork_exec("/proc/self/exe", args, environment, log_path);
}

// ---- the rank side (in the grandchild of the zygote).

// Waits to be reparented to the harness, takes the requested environment and
// output, answers with its pid, and returns into the binary's start-up.
void become_rank(const std::vector<std::string>& request, pid_t middle, pid_t harness, int fd) {
  while (getppid() == middle) {
    const timespec pause{0, 50 * 1000};
    nanosleep(&pause, nullptr);
  }
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (getppid() != harness) _exit(1);  // the harness is gone
  clearenv();
  for (size_t i = 2; i < request.size(); ++i) {
    const auto eq = request[i].find('=');
    if (eq != std::string::npos) setenv(request[i].substr(0, eq).c_str(), request[i].substr(eq + 1).c_str(), 1);
  }
  setenv("GTEST_FILTER", request[0].c_str(), 1);
  const int log = open(request[1].c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (log >= 0) {
    dup2(log, 1);
    dup2(log, 2);
    close(log);
  }
  const int32_t me = getpid();
  write_all(fd, &me, sizeof me);
  close(fd);
}

// In the zygote: serve requests until the harness closes the pipe. Returns
// only in a rank process (true); the zygote itself ends with _exit.
bool serve(int fd, pid_t harness) {
  prctl(PR_SET_CHILD_SUBREAPER, 0);  // orphans must go to the harness, not here
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (getppid() != harness) _exit(1);
  const int32_t ready = thread_count() == 1 ? 0 : -1;  // forking is safe only single-threaded
  write_all(fd, &ready, sizeof ready);
  if (ready != 0) _exit(0);
  std::vector<std::string> request;
  while (read_strings(fd, request)) {
    const pid_t middle = fork();
    if (middle == 0) {
      const pid_t self = getpid();
      const pid_t rank = fork();
      if (rank == 0) {
        become_rank(request, self, harness, fd);
        return true;
      }
      if (rank < 0) {
        const int32_t failed = -1;
        write_all(fd, &failed, sizeof failed);
      }
      _exit(0);
    }
    if (middle < 0) {
      const int32_t failed = -1;
      write_all(fd, &failed, sizeof failed);
      continue;
    }
    waitpid(middle, nullptr, 0);
  }
  _exit(0);
}

// Runs during static initialization: in the zygote this is where it waits.
bool zygote_if_asked() {
  const char* fd = std::getenv("MESHTRAIN_ZYGOTE_FD");
  const char* parent = std::getenv("MESHTRAIN_ZYGOTE_PARENT");
  if (!fd || !parent) return false;
  const int socket_fd = std::atoi(fd);
  const pid_t harness = static_cast<pid_t>(std::atol(parent));
  unsetenv("MESHTRAIN_ZYGOTE_FD");
  unsetenv("MESHTRAIN_ZYGOTE_PARENT");
  return serve(socket_fd, harness);
}

const bool kStartedByZygote = zygote_if_asked();

// ---- the harness side.

struct Zygote {
  bool tried = false;
  int fd = -1;  // our end of the socket pair; -1: no zygote
};

Zygote& zygote() {
  static Zygote z;
  return z;
}

// Starts the zygote: fork + exec of this binary, holding one end of a socket pair.
void start_zygote(Zygote& z) {
  z.tried = true;
  if (std::getenv("MESHTRAIN_HARNESS_NO_ZYGOTE")) return;
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv) != 0) return;
  fcntl(sv[0], F_SETFD, FD_CLOEXEC);
  prctl(PR_SET_CHILD_SUBREAPER, 1);
  // OMP and OpenBLAS threads are read once, as libgomp and OpenBLAS load: a
  // pool started here would make the zygote multithreaded (and every rank
  // gets these values anyway).
  const pid_t pid = fork_exec_self({"/proc/self/exe"},
                                   environment_with({"OMP_NUM_THREADS=1", "OPENBLAS_NUM_THREADS=1",
                                                     "MESHTRAIN_ZYGOTE_FD=" + std::to_string(sv[1]),
                                                     "MESHTRAIN_ZYGOTE_PARENT=" + std::to_string(getpid())}),
                                   "");
  close(sv[1]);
  int32_t ready = -1;
  if (pid < 0 || !read_answer(sv[0], ready, 30000) || ready != 0) {
    close(sv[0]);
    if (pid > 0) {
      kill(pid, SIGKILL);
      waitpid(pid, nullptr, 0);
    }
    return;
  }
  z.fd = sv[0];
}

// A rank forked by the zygote, or -1 when there is none.
pid_t zygote_spawn(const std::vector<std::string>& environment, const std::string& test,
                   const std::string& log_path) {
  Zygote& z = zygote();
  if (!z.tried) start_zygote(z);
  if (z.fd < 0) return -1;
  std::vector<std::string> request = {test, log_path};
  request.insert(request.end(), environment.begin(), environment.end());
  int32_t pid = -1;
  if (!write_strings(z.fd, request) || !read_answer(z.fd, pid, 30000) || pid <= 0) {
    close(z.fd);  // the zygote is broken: from now on, exec
    z.fd = -1;
    return -1;
  }
  return pid;
}

}  // namespace

std::vector<std::string> environment_with(const std::vector<std::string>& extra) {
  std::set<std::string> replaced = {"GTEST_SHARD_INDEX", "GTEST_TOTAL_SHARDS", "GTEST_SHARD_STATUS_FILE"};
  for (const auto& e : extra) replaced.insert(e.substr(0, e.find('=')));
  std::vector<std::string> out;
  for (char** e = environ; *e; ++e) {
    const std::string var = *e;
    if (!replaced.count(var.substr(0, var.find('=')))) out.push_back(var);
  }
  out.insert(out.end(), extra.begin(), extra.end());
  return out;
}

pid_t spawn_command(const std::vector<std::string>& argv, const std::vector<std::string>& environment,
                    const std::string& log_path) {
  return fork_exec(argv.at(0), argv, environment, log_path);
}

pid_t spawn_rank(const std::vector<std::string>& environment, const std::string& test, const std::string& log_path) {
  const pid_t forked = zygote_spawn(environment, test, log_path);
  if (forked > 0) return forked;
  return fork_exec_self({"/proc/self/exe", "--gtest_filter=" + test}, environment, log_path);
}

}  // namespace testing
}  // namespace meshtrain
