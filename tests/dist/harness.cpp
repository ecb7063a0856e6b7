#include "harness.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <thread>

#include "meshtrain/comm.h"
#include "comm/store.h"
#include "util/intercept.h"
#include "zygote.h"


namespace meshtrain {
namespace testing {

namespace {

// Which run_ranks call of the current test this is (the parent and the ranks
// count the same way, because both run the same test body from its start).
int next_call_index() {
  static std::string test;
  static int index = 0;
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  const std::string name = std::string(info->test_suite_name()) + "." + info->name();
  if (name != test) {
    test = name;
    index = 0;
  }
  return index++;
}

const char* env(const char* name) { return std::getenv(name); }

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string current_test_filter() {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  return std::string(info->test_suite_name()) + "." + info->name();
}

bool file_exists(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0;
}

std::string status_file(const std::string& dir, int rank) { return dir + "/rank" + std::to_string(rank) + ".status"; }

// ---- mpirun: see Note [Ranks under mpirun] in harness.h.

bool under_mpirun(const RankOptions& options) {
  return std::find(options.env.begin(), options.env.end(), "MESHTRAIN_BACKEND=mpi") != options.env.end();
}

// In a rank started by mpirun, during static initialization: output to the
// rank's own log in the run's directory (mpirun would interleave the ranks'),
// and death with mpirun (the harness kills mpirun at the time limit).
bool redirect_mpi_rank() {
  const char* mpi = env("MESHTRAIN_HARNESS_MPI");
  const char* rank = env("OMPI_COMM_WORLD_RANK");
  const char* dir = env("MESHTRAIN_HARNESS_DIR");
  if (!mpi || !rank || !dir) return false;
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  const int fd = open((std::string(dir) + "/rank" + rank + ".log").c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd >= 0) {
    dup2(fd, 1);
    dup2(fd, 2);
    close(fd);
  }
  return true;
}

const bool kRedirectedMpiRank = redirect_mpi_rank();

// The end of a rank under mpirun. Its exit ends the job when it fails or skips
// MPI_Finalize, so it records its outcome first (the parent reads it), and a
// passing rank waits for every other rank that must pass to record theirs
// before it finalizes (or leaves, when MPI's state does not allow finalizing).
bool finish_mpi_rank(int rank, int world, bool ok, const RankOptions& options) {
  const std::string dir = shared_dir();
  auto record = [&](const char* outcome) {
    const std::string tmp = status_file(dir, rank) + ".tmp";
    std::ofstream(tmp) << outcome;
    std::rename(tmp.c_str(), status_file(dir, rank).c_str());
  };
  record(ok ? "ok" : "failed");
  if (!ok) return false;
  const auto deadline = std::chrono::steady_clock::now() + options.time_limit;
  for (int q = 0; q < world; ++q) {
    if (q == rank || options.may_die.count(q)) continue;
    while (!file_exists(status_file(dir, q)) && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  }
  try {
    comm::finalize_mpi();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "[harness] rank %d failed: %s\n", rank, e.what());
    record("failed");
    return false;
  }
  return true;
}

// The child side: join, run, exit. Never returns.
[[noreturn]] void run_as_rank(const std::function<void(comm::Communicator&)>& fn,
                              const RankOptions& options) {
  const bool mpi = env("MESHTRAIN_HARNESS_MPI") != nullptr;
  const int rank = std::atoi(env(mpi ? "OMPI_COMM_WORLD_RANK" : "MESHTRAIN_HARNESS_RANK"));
  const int world = std::atoi(env("MESHTRAIN_HARNESS_WORLD"));
  torch::set_num_threads(1);
  std::string error;
  {
    comm::CommOptions opts;
    opts.timeout = options.comm_timeout;
    opts.verify = options.verify;
    if (options.inline_bytes >= 0) opts.inline_bytes = options.inline_bytes;
    comm::CommPtr world_comm;
    try {
      // Under mpirun (MESHTRAIN_BACKEND=mpi) the environment describes an MPI world.
      world_comm = mpi ? comm::init_from_env(opts)
                       : comm::init_with_store("127.0.0.1", std::atoi(env("MESHTRAIN_HARNESS_PORT")), rank, world,
                                               env("MESHTRAIN_HARNESS_GROUP"), opts);
      if (mpi && world_comm->backend() != "mpi") {
        throw std::runtime_error("under mpirun the world runs on backend " + world_comm->backend() + ", not mpi");
      }
      fn(*world_comm);
    } catch (const std::exception& e) {
      error = e.what();
    }
    // The roles of tp::parallelize'd and fully_shard'ed modules hold
    // communicators, which would outlive world_comm and skip the goodbye
    // under _Exit below (Note [Roles live until exit]).
    intercept::forget_all();
    if (!error.empty() || ::testing::Test::HasFailure()) {
      const std::string why = error.empty() ? "a test assertion failed" : "exception: " + error;
      std::fprintf(stderr, "[harness] rank %d failed: %s\n", rank, why.c_str());
      // Tell the others now, so they stop instead of waiting for this rank
      // (under mpirun, this rank's exit does: mpirun ends the job).
      if (!mpi) {
        try {
          const std::string group = env("MESHTRAIN_HARNESS_GROUP");
          comm::TcpStore reporter("127.0.0.1", std::atoi(env("MESHTRAIN_HARNESS_PORT")), std::chrono::seconds(5));
          reporter.report_failure(group + "/r" + std::to_string(rank), "rank " + std::to_string(rank) + " failed its test: " + why);
        } catch (const std::exception&) {
        }
      }
    }
  }  // the communicator says goodbye here
  bool ok = error.empty() && !::testing::Test::HasFailure();
  if (mpi) ok = finish_mpi_rank(rank, world, ok, options);
  std::fflush(stdout);
  std::fflush(stderr);
  std::_Exit(ok ? 0 : 1);
}

struct Child {
  pid_t pid = -1;
  std::string log;
  bool exited = false;
  int status = 0;
};

std::string describe_status(int status) {
  if (WIFEXITED(status)) return "exit code " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return std::string("signal ") + strsignal(WTERMSIG(status));
  return "unknown status";
}

std::string self_executable() {
  char path[4096];
  const ssize_t n = readlink("/proc/self/exe", path, sizeof path - 1);
  return n > 0 ? std::string(path, n) : std::string("/proc/self/exe");
}

std::string find_program(const std::string& name) {
  const char* path = env("PATH");
  std::stringstream dirs(path ? path : "/usr/bin:/bin");
  std::string d;
  while (std::getline(dirs, d, ':')) {
    if (!d.empty() && access((d + "/" + name).c_str(), X_OK) == 0) return d + "/" + name;
  }
  return "/usr/bin/" + name;
}

RankRun run_under_mpirun(int world_size, int call, const std::string& dir, const RankOptions& options) {
  std::vector<std::string> extra = {
      "MESHTRAIN_HARNESS_RANK=mpi",  // the rank is OMPI_COMM_WORLD_RANK
      "MESHTRAIN_HARNESS_MPI=1",
      "MESHTRAIN_HARNESS_WORLD=" + std::to_string(world_size),
      "MESHTRAIN_HARNESS_CALL=" + std::to_string(call),
      "MESHTRAIN_HARNESS_DIR=" + dir,
      "OMP_NUM_THREADS=1",
      "OPENBLAS_NUM_THREADS=1",
  };
  for (const auto& e : options.env) extra.push_back(e);
  std::vector<std::string> argv = {find_program("mpirun"), "--allow-run-as-root", "--oversubscribe", "--bind-to", "none",
                                   "-np", std::to_string(world_size), "--mca", "btl", "self,vader"};
  for (const auto& e : extra) argv.insert(argv.end(), {"-x", e.substr(0, e.find('='))});
  argv.insert(argv.end(), {self_executable(), "--gtest_filter=" + current_test_filter()});
  const std::string mpirun_log = dir + "/mpirun.log";
  const pid_t pid = spawn_command(argv, environment_with(extra), mpirun_log);

  const auto deadline = std::chrono::steady_clock::now() + options.time_limit;
  int status = 0;
  bool timed_out = false;
  while (waitpid(pid, &status, WNOHANG) != pid) {
    if (std::chrono::steady_clock::now() > deadline) {
      // mpirun ends its ranks on SIGTERM; they also die with it (redirect_mpi_rank).
      timed_out = true;
      kill(pid, SIGTERM);
      const auto grace = std::chrono::steady_clock::now() + std::chrono::seconds(5);
      while (waitpid(pid, &status, WNOHANG) != pid) {
        if (std::chrono::steady_clock::now() > grace) {
          kill(pid, SIGKILL);
          waitpid(pid, &status, 0);
          break;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  const auto ended = std::chrono::system_clock::now();

  // mpirun fails the job when any rank leaves without MPI_Finalize, which a
  // rank allowed to die, or one that saw a timeout, does; then only the
  // outcomes the ranks recorded count.
  const bool launcher_ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
  std::ostringstream failures;
  for (int r = 0; r < world_size; ++r) {
    std::string outcome;
    std::ifstream(status_file(dir, r)) >> outcome;
    if (outcome == "ok" || (outcome.empty() && options.may_die.count(r))) continue;
    failures << "---- rank " << r << " of " << world_size << " under mpirun "
             << (outcome == "failed" ? "failed"
                                     : "recorded no outcome (it crashed, or mpirun ended it after another rank's exit)")
             << "; its output:\n"
             << read_file(dir + "/rank" + std::to_string(r) + ".log") << "\n";
  }
  if (timed_out || (!launcher_ok && options.may_die.empty()) || !failures.str().empty()) {
    ADD_FAILURE() << "run_ranks(" << world_size << ") under mpirun failed"
                  << (timed_out ? " (time limit of " + std::to_string(options.time_limit.count()) + " s reached)" : "")
                  << "; mpirun: " << describe_status(status) << ":\n"
                  << failures.str() << "---- mpirun's output:\n" << read_file(mpirun_log) << "\n";
  }
  return RankRun(dir, status, ended);
}

}  // namespace

bool in_rank_process() { return env("MESHTRAIN_HARNESS_RANK") != nullptr; }

std::string shared_dir() {
  const char* d = env("MESHTRAIN_HARNESS_DIR");
  return d ? d : "";
}

RankRun::~RankRun() {
  if (!dir_.empty() && !in_rank_process()) std::system(("rm -rf '" + dir_ + "'").c_str());
}

RankRun run_ranks(int world_size, const std::function<void(comm::Communicator&)>& fn,
               const RankOptions& options) {
  const int call = next_call_index();
  if (in_rank_process()) {
    if (std::atoi(env("MESHTRAIN_HARNESS_CALL")) != call) return RankRun("");  // another call's ranks
    run_as_rank(fn, options);
  }

  char dir_template[] = "/tmp/meshtrain-test-XXXXXX";
  const std::string dir = mkdtemp(dir_template);
  if (under_mpirun(options)) return run_under_mpirun(world_size, call, dir, options);
  comm::StoreServer store("127.0.0.1", 0);
  const std::string group = "h" + std::to_string(call);
  std::vector<Child> children(world_size);
  for (int r = 0; r < world_size; ++r) {
    std::vector<std::string> extra = {
        "MESHTRAIN_HARNESS_RANK=" + std::to_string(r),
        "MESHTRAIN_HARNESS_WORLD=" + std::to_string(world_size),
        "MESHTRAIN_HARNESS_CALL=" + std::to_string(call),
        "MESHTRAIN_HARNESS_PORT=" + std::to_string(store.port()),
        "MESHTRAIN_HARNESS_GROUP=" + group,
        "MESHTRAIN_HARNESS_DIR=" + dir,
        "OMP_NUM_THREADS=1",
        "OPENBLAS_NUM_THREADS=1",
    };
    if (options.hosts > 1) extra.push_back("MESHTRAIN_HOST_ID=host" + std::to_string(r * options.hosts / world_size));
    for (const auto& e : options.env) extra.push_back(e);
    children[r].log = dir + "/rank" + std::to_string(r) + ".log";
    children[r].pid = spawn_rank(environment_with(extra), current_test_filter(), children[r].log);
  }

  const auto deadline = std::chrono::steady_clock::now() + options.time_limit;
  bool timed_out = false;
  while (true) {
    int running = 0, running_required = 0;
    for (int r = 0; r < world_size; ++r) {
      Child& c = children[r];
      if (c.exited) continue;
      if (waitpid(c.pid, &c.status, WNOHANG) == c.pid) {
        c.exited = true;
        continue;
      }
      ++running;
      if (!options.may_die.count(r)) ++running_required;
    }
    if (running == 0) break;
    // Once the ranks that must finish have, the ones allowed to die (stopped
    // on purpose, say) are killed; if every rank may die, wait for them.
    const bool only_optional_left = running_required == 0 && static_cast<int>(options.may_die.size()) < world_size;
    const bool late = std::chrono::steady_clock::now() > deadline;
    if (only_optional_left || late) {
      timed_out = late && !only_optional_left;
      for (auto& c : children) {
        if (!c.exited) {
          kill(c.pid, SIGKILL);
          waitpid(c.pid, &c.status, 0);
          c.exited = true;
          if (timed_out) c.status = -1;
        }
      }
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }

  std::ostringstream failures;
  for (int r = 0; r < world_size; ++r) {
    const Child& c = children[r];
    const bool ok_exit = WIFEXITED(c.status) && WEXITSTATUS(c.status) == 0 && c.status != -1;
    const bool allowed_death = options.may_die.count(r) && WIFSIGNALED(c.status);
    if (ok_exit || allowed_death) continue;
    failures << "---- rank " << r << " of " << world_size << " failed ("
             << (c.status == -1 ? "killed at the time limit of " +
                                      std::to_string(options.time_limit.count()) + " s"
                                : describe_status(c.status))
             << "); its output:\n"
             << read_file(c.log) << "\n";
  }
  const std::string report = failures.str();
  if (!report.empty()) {
    ADD_FAILURE() << "run_ranks(" << world_size << ") failed"
                  << (timed_out ? " (time limit reached)" : "") << ":\n" << report;
  } else {
    for (int r = 0; r < world_size; ++r) std::remove(children[r].log.c_str());
  }
  return RankRun(dir);
}

}  // namespace testing
}  // namespace meshtrain
