// meshtrain under Slurm for real (issue 30 item 3b): a private Slurm cluster
// (munged, slurmctld, one slurmd per namespaced test host: tests/cluster/
// slurm.sh) runs examples/slurm/train.sbatch, whose srun starts meshtrain on
// every task; the ranks take their places from SLURM_* alone.
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <string>
#include <thread>

#include "../dist/metrics.h"
#include "../dist/shell.h"
#include "cluster.h"
#include "meshtrain/util.h"
#include "util/files.h"

using meshtrain::str_cat;
using meshtrain::testing::contains;
using meshtrain::testing::expect_same_losses;
using meshtrain::testing::kBin;
using meshtrain::testing::kSource;
using meshtrain::testing::kTiny;
using meshtrain::testing::sh;
using meshtrain::testing::Shell;
using meshtrain::testing::TempDir;

namespace {

const std::string kSlurm = kSource + "/tests/cluster/slurm.sh";
const std::string kSbatch = kSource + "/examples/slurm/train.sbatch";

// A Slurm cluster of N namespaced hosts for one test, removed with everything
// in it when the test ends.
class SlurmCluster {
 public:
  explicit SlurmCluster(int n) : n_(n) {
    const int id = static_cast<int>(::getpid() % 100000);
    name_ = str_cat("ms", id);
    subnet_ = str_cat("10.", 100 + id % 100, ".", id / 100 % 250);
    Shell r = sh(str_cat(kSlurm, " up ", name_, " ", n, " ", dir_.file("slurm"), " ", subnet_));
    status_ = r.exit_code;
    why_ = r.output;
  }
  ~SlurmCluster() { sh(str_cat(kSlurm, " down ", name_, " ", n_, " ", dir_.file("slurm"))); }
  // slurm.sh's exit: 0 up, 3 no namespaces here, anything else a failure.
  int status() const { return status_; }
  const std::string& why() const { return why_; }
  // A Slurm command on the head node, the job's environment given as `env` (VAR=value ...).
  Shell run(const std::string& env, const std::string& command) const {
    return sh(str_cat(env, " ", kSlurm, " run ", name_, " ", dir_.file("slurm"), " ", command));
  }
  // meshtrain processes still running on host i.
  std::string meshtrain_processes(int i) const {
    return sh(str_cat("for p in $(ip netns pids ", name_, i, "); do ",
                      "grep -qx meshtrain /proc/$p/comm 2>/dev/null && echo \"$p $(tr '\\0' ' ' < /proc/$p/cmdline)\"; ",
                      "done"))
        .output;
  }
  // What is in host i's /dev/shm (its slurmd's mount namespace, which the job's ranks share).
  Shell shm(int i) const {
    return sh(str_cat("nsenter -t $(cat ", dir_.file("slurm"), "/slurmd.", name_, i, ".pid) -m ls -A /dev/shm"));
  }
  std::string logs() const {
    return sh(str_cat("tail -n 30 ", dir_.file("slurm"), "/*.log")).output;
  }

 private:
  int n_;
  TempDir dir_;
  std::string name_, subnet_, why_;
  int status_ = -1;
};

// Skips only where this machine cannot make the hosts (not root, no network
// namespaces); a cluster that does not come up fails the test.
#define SLURM_CLUSTER(var, n)                                                                 \
  if (::geteuid() != 0) GTEST_SKIP() << "needs root: network namespaces and slurmd";          \
  SlurmCluster var(n);                                                                        \
  if (var.status() == 3) GTEST_SKIP() << "cannot make network namespaces here: " << var.why(); \
  ASSERT_EQ(var.status(), 0) << "the Slurm cluster did not come up:\n" << var.why()

}  // namespace

// sbatch --wait of the example on 2 nodes of 2 tasks ends, and the 4 ranks
// (dp 2 x pp 2, the hierarchical backend: shared memory inside a node, Gloo
// between) train like one process.
TEST(Slurm, SbatchTheExampleOnTwoNodesTrainsLikeOneProcess) {
  SLURM_CLUSTER(cluster, 2);
  TempDir t;
  const std::string common = kTiny + "--steps 8 --log-every 1 ";
  Shell r = cluster.run("MESHTRAIN=" + kBin + "/meshtrain",
                        str_cat("sbatch --wait --output=", t.file("job.log"), " ", kSbatch, common,
                                "--dp 2 --pp 2 --metrics-out ", t.file("m.json")));
  const std::string log = meshtrain::files::read_all(t.file("job.log"));
  ASSERT_EQ(r.exit_code, 0) << r.output << "\n--- job log\n" << log << "\n--- Slurm\n" << cluster.logs();
  EXPECT_TRUE(contains(log, "communication backend hierarchical (world of 4")) << log;
  // The batch script runs on the first node, which hosts the store: ms<id>0 (Slurm writes the list ms[<id>0-<id>1]).
  EXPECT_TRUE(contains(log, str_cat(": 4 ranks on ms[", ::getpid() % 100000, "0-"))) << log;
  EXPECT_TRUE(contains(log, str_cat("store at ms", ::getpid() % 100000, "0:"))) << log;
  Shell one = sh(kBin + "/meshtrain" + common + "--metrics-out " + t.file("one.json"));
  ASSERT_EQ(one.exit_code, 0) << one.output;
  expect_same_losses(meshtrain::json::parse_file(t.file("m.json")), meshtrain::json::parse_file(t.file("one.json")),
                     "sbatch on 2 nodes");
}

// scancel of a training job stops every rank on every node within seconds
// (Slurm sends SIGTERM to every process of the step; KillWait 5 s before
// SIGKILL), leaving no meshtrain process and no shared-memory segment.
TEST(Slurm, ScancelStopsEveryRankOnEveryNode) {
  SLURM_CLUSTER(cluster, 2);
  TempDir t;
  Shell submit = cluster.run("MESHTRAIN=" + kBin + "/meshtrain",
                             str_cat("sbatch --parsable --output=", t.file("job.log"), " ", kSbatch, kTiny,
                                     "--steps 1000000 --log-every 1 --dp 2 --pp 2"));
  ASSERT_EQ(submit.exit_code, 0) << submit.output;
  const std::string job = submit.output.substr(0, submit.output.find_first_of(";\n"));
  std::string log;
  for (int i = 0; i < 600 && !contains(log, "step "); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    log = meshtrain::files::exists(t.file("job.log")) ? meshtrain::files::read_all(t.file("job.log")) : "";
  }
  ASSERT_TRUE(contains(log, "step ")) << "job " << job << " did not train within 60 s:\n" << log << cluster.logs();
  ASSERT_NE(cluster.meshtrain_processes(0), "");
  ASSERT_NE(cluster.meshtrain_processes(1), "");

  const auto t0 = std::chrono::steady_clock::now();
  Shell cancel = cluster.run("", "scancel " + job);
  ASSERT_EQ(cancel.exit_code, 0) << cancel.output;
  double seconds = 0;
  std::string left;
  do {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    left = cluster.meshtrain_processes(0) + cluster.meshtrain_processes(1);
    seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  } while (!left.empty() && seconds < 30);
  log = meshtrain::files::read_all(t.file("job.log"));
  EXPECT_EQ(left, "") << "still running " << seconds << " s after scancel:\n" << log << cluster.logs();
  EXPECT_LT(seconds, 5 + 5) << log;  // SIGTERM ends them at once; SIGKILL would come at KillWait (5 s)
  EXPECT_TRUE(contains(log, "CANCELLED")) << log;
  for (int i = 0; i < 2; ++i) {
    Shell shm = cluster.shm(i);
    EXPECT_EQ(shm.exit_code, 0) << shm.output;
    EXPECT_EQ(shm.output, "") << "host " << i << " kept /dev/shm segments after scancel";
  }
  Shell queue = cluster.run("", "squeue -h -j " + job + " -o %T");
  EXPECT_FALSE(contains(queue.output, "RUNNING")) << queue.output;
}
