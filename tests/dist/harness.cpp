#include "harness.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <torch/torch.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <thread>

#include "meshtrain/comm/rendezvous.h"
#include "meshtrain/comm/store.h"
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

// The child side: join, run, exit. Never returns.
[[noreturn]] void run_as_rank(const std::function<void(comm::Communicator&)>& fn,
                              const RankOptions& options) {
  const int rank = std::atoi(env("MESHTRAIN_HARNESS_RANK"));
  const int world = std::atoi(env("MESHTRAIN_HARNESS_WORLD"));
  const int port = std::atoi(env("MESHTRAIN_HARNESS_PORT"));
  const std::string group = env("MESHTRAIN_HARNESS_GROUP");
  torch::set_num_threads(1);
  std::string error;
  {
    comm::CommOptions opts;
    opts.timeout = options.comm_timeout;
    opts.verify = options.verify;
    if (options.inline_bytes >= 0) opts.inline_bytes = options.inline_bytes;
    comm::CommPtr world_comm;
    try {
      world_comm = comm::init_with_store("127.0.0.1", port, rank, world, group, opts);
      fn(*world_comm);
    } catch (const std::exception& e) {
      error = e.what();
    }
    if (!error.empty() || ::testing::Test::HasFailure()) {
      const std::string why = error.empty() ? "a test assertion failed" : "exception: " + error;
      std::fprintf(stderr, "[harness] rank %d failed: %s\n", rank, why.c_str());
      // Tell the others now, so they stop instead of waiting for this rank.
      try {
        comm::TcpStore reporter("127.0.0.1", port, std::chrono::seconds(5));
        reporter.report_failure(group + "/r" + std::to_string(rank), "rank " + std::to_string(rank) + " failed its test: " + why);
      } catch (const std::exception&) {
      }
    }
  }  // the communicator says goodbye here
  std::fflush(stdout);
  std::fflush(stderr);
  std::_Exit(error.empty() && !::testing::Test::HasFailure() ? 0 : 1);
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

  comm::StoreServer store("127.0.0.1", 0);
  char dir_template[] = "/tmp/meshtrain-test-XXXXXX";
  const std::string dir = mkdtemp(dir_template);
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
