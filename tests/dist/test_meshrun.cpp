// meshrun end to end: environment, prefixed output, failure propagation,
// restarts, no orphans, and two meshrun "nodes" forming one group on loopback.

#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <map>
#include <sstream>
#include <thread>

#include "meshtrain/util/files.h"
#include "meshtrain/util/json.h"
#include "meshtrain/util/error.h"
#include "shell.h"

using meshtrain::testing::contains;
using meshtrain::testing::free_port;
using meshtrain::testing::kBin;
using meshtrain::testing::kMeshrun;
using meshtrain::testing::Shell;
using meshtrain::testing::sh;
using meshtrain::testing::TempDir;
using meshtrain::str_cat;

namespace {

bool alive(pid_t pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  if (!stat) return false;
  std::string s;
  std::getline(stat, s);
  const auto close_paren = s.rfind(')');
  return close_paren != std::string::npos && s.size() > close_paren + 2 && s[close_paren + 2] != 'Z';
}

const std::string kHelper = kBin + "/meshrun_helper";

}  // namespace

TEST(Meshrun, SetsTorchrunEnvironmentAndPrefixesEveryLine) {
  Shell r = sh(kMeshrun + "--nproc-per-node 3 -- " + kHelper + " env");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (int rank = 0; rank < 3; ++rank) {
    const std::string p = "[rank" + std::to_string(rank) + "]: ";
    EXPECT_TRUE(contains(r.output, p + "RANK=" + std::to_string(rank) + "\n")) << r.output;
    EXPECT_TRUE(contains(r.output, p + "LOCAL_RANK=" + std::to_string(rank) + "\n")) << r.output;
    EXPECT_TRUE(contains(r.output, p + "WORLD_SIZE=3\n")) << r.output;
    EXPECT_TRUE(contains(r.output, p + "OMP_NUM_THREADS=")) << r.output;
    EXPECT_TRUE(contains(r.output, p + "line without newline\n")) << r.output;
  }
}

TEST(Meshrun, FailedRankStopsTheOthersAndIsNamed) {
  Shell r = sh(kMeshrun + "--nproc-per-node 3 --grace-seconds 2 -- " + kHelper + " fail 1 7");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_TRUE(contains(r.output, "rank 1 (node 0, local rank 1) failed with exit code 7")) << r.output;
  EXPECT_LT(r.seconds, 15.0) << "the sleeping ranks were not stopped:\n" << r.output;
}

// A rank that leaves a child in another session (setsid: out of its process
// group) neither keeps meshrun waiting after the job ends nor outlives it:
// the child carries the job's tag in its environment (Note [No orphans]).
TEST(Meshrun, ChildrenInAnotherSessionDoNotOutliveTheJob) {
  char tmpl[] = "/tmp/meshrun-setsid-XXXXXX";
  const std::string dir = mkdtemp(tmpl);
  const std::string leave_child = "setsid sleep 1000 & echo $! > " + dir + "/child$RANK; ";
  Shell r = sh(kMeshrun + "--nproc-per-node 2 -- bash -c '" + leave_child + "echo trained'");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_LT(r.seconds, 10.0) << "meshrun waited for the setsid child:\n" << r.output;
  for (const char* name : {"child0", "child1"}) {
    std::ifstream in(dir + "/" + name);
    pid_t p = 0;
    ASSERT_TRUE(in >> p) << name;
    EXPECT_FALSE(alive(p)) << "setsid child " << p << " outlived a job that ended normally";
    std::remove((dir + "/" + name).c_str());
  }
  // meshrun SIGKILLed while its ranks and their setsid children run: the guard sweeps them.
  const pid_t pid = fork();
  if (pid == 0) {
    const std::string cmd = kBin + "/meshrun", script = leave_child + "sleep 1000";
    execl(cmd.c_str(), cmd.c_str(), "--master-port", "0", "--nproc-per-node", "2", "--", "bash", "-c",
          script.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  std::vector<pid_t> children;
  for (int i = 0; i < 200 && children.size() < 2; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    children.clear();
    for (const char* name : {"child0", "child1"}) {
      std::ifstream in(dir + "/" + name);
      pid_t p = 0;
      if (in >> p) children.push_back(p);
    }
  }
  ASSERT_EQ(children.size(), 2u);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  kill(pid, SIGKILL);
  waitpid(pid, nullptr, 0);
  for (int i = 0; i < 40 && (alive(children[0]) || alive(children[1])); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  for (pid_t p : children) EXPECT_FALSE(alive(p)) << "setsid child " << p << " outlived meshrun's SIGKILL";
  std::system(("rm -rf " + dir).c_str());
}

TEST(Meshrun, RestartsTheGroupUpToMaxRestarts) {
  Shell ok = sh(kMeshrun + "--nproc-per-node 2 --max-restarts 2 -- " + kHelper + " fail-first 0");
  EXPECT_EQ(ok.exit_code, 0) << ok.output;
  EXPECT_TRUE(contains(ok.output, "restarting the whole group (restart 1 of 2)")) << ok.output;
  EXPECT_TRUE(contains(ok.output, "[rank1]: attempt 1 ok")) << ok.output;
  Shell bad = sh(kMeshrun + "--nproc-per-node 2 --max-restarts 2 --grace-seconds 1 -- " + kHelper + " fail 0 5");
  EXPECT_EQ(bad.exit_code, 1) << bad.output;
  EXPECT_TRUE(contains(bad.output, "restart 2 of 2")) << bad.output;
  EXPECT_TRUE(contains(bad.output, "(after 2 restarts)")) << bad.output;
}

TEST(Meshrun, NoOrphansWhenMeshrunIsKilled) {
  char tmpl[] = "/tmp/meshrun-orphans-XXXXXX";
  const std::string dir = mkdtemp(tmpl);
  const pid_t pid = fork();
  if (pid == 0) {
    const std::string cmd = kBin + "/meshrun";
    execl(cmd.c_str(), cmd.c_str(), "--master-port", "0", "--nproc-per-node", "2", "--",
          kHelper.c_str(), "grandchild", dir.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  std::vector<pid_t> pids;
  for (int i = 0; i < 200 && pids.size() < 4; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    pids.clear();
    for (const char* name : {"rank0", "rank1", "grandchild0", "grandchild1"}) {
      std::ifstream in(dir + "/" + name);
      pid_t p = 0;
      if (in >> p) pids.push_back(p);
    }
  }
  ASSERT_EQ(pids.size(), 4u) << "ranks did not start";
  kill(pid, SIGKILL);  // meshrun dies without any chance to clean up
  waitpid(pid, nullptr, 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  for (pid_t p : pids) EXPECT_FALSE(alive(p)) << "pid " << p << " outlived meshrun";
  // SIGTERM to meshrun: it stops the ranks (and their children) and exits.
  Shell r = sh("(" + kBin + "/meshrun --master-port 0 --nproc-per-node 2 --grace-seconds 1 -- " + kHelper +
             " grandchild " + dir + " & M=$!; sleep 1.5; kill -TERM $M; wait $M; echo meshrun-exit=$?)");
  EXPECT_TRUE(contains(r.output, "meshrun-exit=143")) << r.output;
  pids.clear();
  for (const char* name : {"rank0", "rank1", "grandchild0", "grandchild1"}) {
    std::ifstream in(dir + "/" + name);
    pid_t p = 0;
    if (in >> p) pids.push_back(p);
  }
  for (pid_t p : pids) EXPECT_FALSE(alive(p)) << "pid " << p << " outlived meshrun's SIGTERM";
}

// meshrun makes a token per job and hands it to its ranks in the environment;
// a process without it cannot report a rank dead or join the store (the
// store says so), and the job trains on (Note [Store authentication]).
TEST(Meshrun, AStrangerOnTheStorePortIsRefusedAndTheJobGoesOn) {
  Shell r = sh(kMeshrun + "--nproc-per-node 2 -- " + kHelper + " stranger");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "token in the environment: 64 characters")) << r.output;
  EXPECT_TRUE(contains(r.output, "it sent a request before proving it knows the job's token")) << r.output;
  EXPECT_TRUE(contains(r.output, "stranger: refused: the rendezvous store at 127.0.0.1:")) << r.output;
  EXPECT_TRUE(contains(r.output, "requires a rendezvous token and this process has none")) << r.output;
  EXPECT_FALSE(contains(r.output, "forged by a stranger")) << r.output;
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_TRUE(contains(r.output, "[rank" + std::to_string(rank) + "]: rank " + std::to_string(rank) + " of 2 sum 3"))
        << r.output;
  }
}

// Several nodes share the token through a file (--rdzv-token-file).
TEST(Meshrun, TwoNodesOnLoopbackFormOneGroup) {
  const std::string port = std::to_string(free_port());
  const std::string token = "/tmp/meshrun-token-" + port;
  std::ofstream(token) << "0123456789abcdef0123456789abcdef\n";
  const std::string common = kBin + "/meshrun --nnodes 2 --nproc-per-node 2 --master-addr 127.0.0.1 --rdzv-token-file " +
                             token + " --master-port " + port;
  Shell r = sh("(" + common + " --node-rank 1 -- " + kHelper + " allreduce > /tmp/meshrun-node1-" + port + ".log 2>&1 & " +
             common + " --node-rank 0 -- " + kHelper + " allreduce; wait; cat /tmp/meshrun-node1-" + port + ".log)");
  std::remove(token.c_str());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_FALSE(contains(r.output, "no rendezvous token")) << r.output;
  for (int rank = 0; rank < 4; ++rank) {
    EXPECT_TRUE(contains(r.output, "[rank" + std::to_string(rank) + "]: rank " + std::to_string(rank) + " of 4 sum 10"))
        << r.output;
  }
}

// Issue 31, item 6 (Note [Token mismatch]): nodes whose tokens differ, or where
// only one has a token, stop at once on both nodes (node 0 used to wait out
// --rdzv-timeout and blame --nnodes), each naming the token's file and the fix.
TEST(Meshrun, NodesWithoutTheSameTokenStopAtOnceOnEveryNode) {
  TempDir dir;
  std::ofstream(dir.file("a")) << "0123456789abcdef0123456789abcdef\n";
  std::ofstream(dir.file("b")) << "fedcba9876543210fedcba9876543210\n";
  struct Case {
    std::string node0, node1, says0, says1;
  };
  const std::vector<Case> cases = {
      {"a", "b", "came with another rendezvous token than this job's",
       "refused this process's rendezvous token (--rdzv-token-file " + dir.file("b") + ")"},
      {"a", "", "came with no rendezvous token, and this job has one",
       "requires a rendezvous token and this process has none"},
      {"", "b", "node 1's meshrun came with a rendezvous token (--rdzv-token-file " + dir.file("b") + ")",
       "takes no rendezvous token, and this node has one (--rdzv-token-file " + dir.file("b") + ")"},
  };
  for (const Case& c : cases) {
    const std::string port = std::to_string(free_port());
    const auto node = [&](int rank, const std::string& token) {
      return str_cat("env -u MESHTRAIN_RDZV_TOKEN ", kBin, "/meshrun --nnodes 2 --node-rank ", rank,
                     " --nproc-per-node 1 --master-addr 127.0.0.1 --master-port ", port, " --rdzv-timeout 60",
                     token.empty() ? "" : " --rdzv-token-file " + dir.file(token), " -- true");
    };
    const std::string log1 = dir.file("node1-" + port + ".log");
    Shell r = sh("(" + node(1, c.node1) + " > " + log1 + " 2>&1; echo node 1 exit $? >> " + log1 + ") & " +
                 node(0, c.node0) + " 2>&1; echo node 0 exit $?; wait; cat " + log1);
    EXPECT_TRUE(contains(r.output, "node 0 exit 2")) << r.output;
    EXPECT_TRUE(contains(r.output, "node 1 exit 2")) << r.output;
    EXPECT_TRUE(contains(r.output, "meshrun: stopped waiting for the other nodes: ")) << r.output;
    EXPECT_TRUE(contains(r.output, c.says0)) << r.output;
    EXPECT_TRUE(contains(r.output, c.says1)) << r.output;
    EXPECT_TRUE(contains(r.output, "every node's meshrun needs the same token")) << r.output;
    EXPECT_FALSE(contains(r.output, "timed out")) << r.output;
    EXPECT_LT(r.seconds, 15.0) << r.output;
  }
}

TEST(Meshrun, BadArgumentsGiveUsage) {
  Shell r = sh(kBin + "/meshrun --nproc-per-node 0 -- true");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_TRUE(contains(r.output, "--nproc-per-node 0 must be at least 1")) << r.output;
  r = sh(kBin + "/meshrun --nnodes 2 --master-port 0 -- true");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_TRUE(contains(r.output, "works on one node only")) << r.output;
  r = sh(kBin + "/meshrun --nproc-per-node 2");
  EXPECT_TRUE(contains(r.output, "no program given")) << r.output;
  r = sh(kBin + "/meshrun --bogus 1 -- true");
  EXPECT_TRUE(contains(r.output, "unknown flag '--bogus'")) << r.output;
  r = sh(kBin + "/meshrun --nproc-per-node 1 --master-port 0 -- /nonexistent/program");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_TRUE(contains(r.output, "cannot execute '/nonexistent/program'")) << r.output;
}

// torchrun's spellings: --standalone, --rdzv-endpoint, --nproc-per-node auto,
// --rdzv-timeout; --quiet drops meshrun's own lines; a node waiting for the
// others says so.
TEST(Meshrun, TorchrunFlagsAndQuiet) {
  Shell r = sh(kBin + "/meshrun --standalone --nproc_per_node=2 -- " + kHelper + " allreduce");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "[rank1]: rank 1 of 2 sum 3")) << r.output;
  r = sh(kBin + "/meshrun --rdzv-endpoint 127.0.0.1:" + std::to_string(free_port()) + " --nproc-per-node 2 --quiet -- " +
         kHelper + " allreduce");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_FALSE(contains(r.output, "meshrun: starting")) << r.output;
  r = sh(kBin + "/meshrun --standalone --nproc-per-node auto -- " + kHelper + " env");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "WORLD_SIZE=" + std::to_string(std::max(1u, std::thread::hardware_concurrency())))) << r.output;
  // Node 0 of 2 alone: it waits, says so, and gives up after --rdzv-timeout.
  r = sh(kBin + "/meshrun --nnodes 2 --rdzv-endpoint 127.0.0.1:" + std::to_string(free_port()) +
         " --rdzv-timeout 7 --nproc-per-node 1 -- true");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "waiting for the other nodes: 1 of 2 nodes so far")) << r.output;
  EXPECT_TRUE(contains(r.output, "timed out waiting for the other nodes")) << r.output;
  EXPECT_LT(r.seconds, 15.0) << r.output;
  r = sh(kBin + "/meshrun --standalone --nnodes 2 -- true");
  EXPECT_TRUE(contains(r.output, "--standalone is one node")) << r.output;
  // --help: to stdout, success; every flag listed (meshrun and the trainer).
  r = sh(kBin + "/meshrun --help 2>/dev/null");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  for (const char* flag : {"--nproc-per-node", "--rdzv-endpoint", "--standalone", "--rdzv-timeout", "--quiet", "--max-restarts"})
    EXPECT_TRUE(contains(r.output, flag)) << flag << "\n" << r.output;
  r = sh(kBin + "/meshtrain --help 2>/dev/null");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  for (const char* flag : {"--data", "--async-save", "--zero", "--pp", "--clip-grad-norm"})
    EXPECT_TRUE(contains(r.output, flag)) << flag << "\n" << r.output;
}

// kill -9 of a rank in the middle of a step: meshrun stops the group and
// restarts it, training resumes from the last checkpoint, and the losses of the
// steps after it equal those of the uninterrupted run (same layout: exactly).
TEST(Meshrun, RestartAfterACrashResumesFromTheLastCheckpoint) {
  char tmpl[] = "/tmp/meshrun-restart-XXXXXX";
  const std::string dir = mkdtemp(tmpl);
  const std::string train = kBin + "/meshtrain --model gpt --steps 8 --eval-problems 0 --log-every 1 ";
  Shell plain = sh(kMeshrun + "--nproc-per-node 2 -- " + train + "--metrics-out " + dir + "/plain.json");
  ASSERT_EQ(plain.exit_code, 0) << plain.output;
  Shell crash = sh("MESHTRAIN_TEST_KILL_AT_STEP=5 MESHTRAIN_TEST_KILL_RANK=1 " + kMeshrun +
                   "--nproc-per-node 2 --max-restarts 1 --grace-seconds 2 -- " + train + "--save-dir " + dir +
                   "/ckpt --save-every 2 --resume --metrics-out " + dir + "/resumed.json");
  ASSERT_EQ(crash.exit_code, 0) << crash.output;
  EXPECT_TRUE(contains(crash.output, "rank 1 (node 0, local rank 1) failed with signal Killed")) << crash.output;
  EXPECT_TRUE(contains(crash.output, "restarting the whole group (restart 1 of 1)")) << crash.output;
  EXPECT_TRUE(contains(crash.output, "resumed from checkpoint step 4")) << crash.output;
  EXPECT_TRUE(contains(crash.output, "first step after the restart done")) << crash.output;
  auto a = meshtrain::json::parse(meshtrain::files::read_all(dir + "/plain.json"));
  auto b = meshtrain::json::parse(meshtrain::files::read_all(dir + "/resumed.json"));
  ASSERT_EQ(b["first_step"].num(), 4);
  ASSERT_EQ(b["losses"].size(), 4u);
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(b["losses"][i].num(), a["losses"][4 + i].num()) << "step " << 4 + i;  // bitwise: the same computation
  }
  std::system(("rm -rf " + dir).c_str());
}

namespace {

// The loss of each step on the progress lines of a log ("step   5/40 | loss   3.8348 | ..."), the last line of each step.
std::map<int, double> progress_losses(const std::string& log) {
  std::map<int, double> losses;
  std::istringstream in(log);
  std::string line;
  while (std::getline(in, line)) {
    int step = 0, steps = 0;
    double loss = 0;
    const auto at = line.find("step ");
    if (at != std::string::npos && std::sscanf(line.c_str() + at, "step %d/%d | loss %lf", &step, &steps, &loss) == 3)
      losses[step] = loss;
  }
  return losses;
}

// meshrun --nnodes 1:2, two nodes on loopback: node 1's meshrun is killed
// (SIGKILL) in step 6; node 0 goes on alone on the planner's layout for 2
// ranks from the checkpoint of step 4; node 1 comes back, node 0's ranks stop
// at their next checkpoint and the job finishes on both nodes again. Returns
// the job's output; dir holds plain.json (the uninterrupted single-process
// run of the same flags), elastic.json (the last round's metrics) and the logs.
Shell run_elastic_job(const std::string& dir, const std::string& flags) {
  const std::string train = kBin + "/meshtrain --model gpt --steps 40 --global-batch 8 --eval-problems 0 " + flags + " ";
  Shell plain = sh(train + "--metrics-out " + dir + "/plain.json");
  EXPECT_EQ(plain.exit_code, 0) << plain.output;
  const std::string node = "MESHTRAIN_RDZV_TOKEN=0123456789abcdef0123456789abcdef " + kBin +
                           "/meshrun --nnodes 1:2 --nproc-per-node 2 --master-port " + std::to_string(free_port()) +
                           " --rdzv-last-call 5 --rdzv-timeout 60 --max-restarts 1 --grace-seconds 2 --node-rank ";
  const std::string job = " -- " + train + "--dp 2 --pp 2 --save-dir " + dir + "/ckpt --save-every 2 --resume " +
                          "--metrics-out " + dir + "/elastic.json";
  const std::string kill_node1 = "MESHTRAIN_TEST_KILL_AT_STEP=5 MESHTRAIN_TEST_KILL_RANK=2 MESHTRAIN_TEST_KILL_TARGET=meshrun ";
  Shell r = sh("cd " + dir + "; (" + kill_node1 + node + "1" + job + " > node1.log 2>&1; echo node1 rc $? >> node1.log) & " +
               node + "0" + job + " > node0.log 2>&1 & node0=$!; wait %1; " +
               "for i in $(seq 600); do grep -q 'round 1' node0.log && break; sleep 0.05; done; " +
               node + "1" + job + " > node1-back.log 2>&1; echo node1-back rc $?; wait $node0; echo node0 rc $?; " +
               "cat node0.log node1.log node1-back.log");
  EXPECT_TRUE(contains(r.output, "node1 rc 137")) << r.output;  // its meshrun was killed
  EXPECT_TRUE(contains(r.output, "node1-back rc 0")) << r.output;
  EXPECT_TRUE(contains(r.output, "node0 rc 0")) << r.output;
  EXPECT_TRUE(contains(r.output, "meshrun: round 1: nodes 0, 2 ranks (without node 1)")) << r.output;
  EXPECT_TRUE(contains(r.output, "(the planner)")) << r.output;  // the flags' dp 2 x pp 2 needs 4 ranks
  EXPECT_TRUE(contains(r.output, "resumed from checkpoint step 4")) << r.output;
  EXPECT_TRUE(contains(r.output, "a node is waiting to join: stopping after the checkpoint of step")) << r.output;
  EXPECT_TRUE(contains(r.output, "meshrun: round 2: nodes 0, 1, 4 ranks (node 1 joined)")) << r.output;
  return r;
}

}  // namespace

// Every step's loss equals the uninterrupted single-process run's (the
// global batch never changes).
TEST(Meshrun, ElasticJobGoesOnWithoutALostNodeAndTakesItBack) {
  TempDir t;
  const std::string& dir = t.path();
  const Shell r = run_elastic_job(dir, "");
  const auto reference = meshtrain::json::parse(meshtrain::files::read_all(dir + "/plain.json"));
  const auto elastic = meshtrain::json::parse(meshtrain::files::read_all(dir + "/elastic.json"));
  // The last round, from its metrics: equal up to float reassociation (another layout than one process).
  const int first = static_cast<int>(elastic["first_step"].num());
  ASSERT_GT(first, 4);
  ASSERT_EQ(elastic["losses"].size(), static_cast<size_t>(40 - first));
  for (int s = first; s < 40; ++s) {
    const double want = reference["losses"][s].num();
    EXPECT_NEAR(elastic["losses"][s - first].num(), want, 1e-5 * std::abs(want)) << "step " << s + 1;
  }
  // Every step of every round (node 0's progress lines, four decimals): the same losses.
  const auto printed = progress_losses(meshtrain::files::read_all(dir + "/node0.log"));
  ASSERT_EQ(printed.size(), 40u) << r.output;
  for (const auto& step_loss : printed) {
    EXPECT_NEAR(step_loss.second, reference["losses"][step_loss.first - 1].num(), 1e-4) << "step " << step_loss.first;
  }
}

// Issue 33: the same job under --deterministic, through dp 2 x pp 2, the
// planner's 2-rank layout and back, ends with the uninterrupted one-process
// run's bits: every loss of the last round equal (==), and the weights' SHA-256.
TEST(Meshrun, DeterministicElasticJobEndsWithTheUninterruptedRunsWeights) {
  TempDir t;
  const std::string& dir = t.path();
  const Shell r = run_elastic_job(dir, "--deterministic --clip-grad-norm 1");
  const auto reference = meshtrain::json::parse(meshtrain::files::read_all(dir + "/plain.json"));
  const auto elastic = meshtrain::json::parse(meshtrain::files::read_all(dir + "/elastic.json"));
  const int first = static_cast<int>(elastic["first_step"].num());
  ASSERT_GT(first, 4);
  ASSERT_EQ(elastic["losses"].size(), static_cast<size_t>(40 - first));
  for (int s = first; s < 40; ++s) EXPECT_EQ(elastic["losses"][s - first].num(), reference["losses"][s].num()) << s + 1;
  EXPECT_EQ(elastic["weights_sha256"].str(), reference["weights_sha256"].str()) << r.output;
  EXPECT_EQ(reference["weights_sha256"].str().size(), 64u);
}

// A node that arrives when the job cannot take it in (no checkpoints) waits
// and, when the job finishes, exits 0 saying so: node 0 keeps the store up
// until it has seen the news.
TEST(Meshrun, ElasticNodeStillWaitingWhenTheJobEndsExitsZero) {
  const std::string node = "MESHTRAIN_RDZV_TOKEN=0123456789abcdef0123456789abcdef " + kBin +
                           "/meshrun --nnodes 1:2 --nproc-per-node 1 --rdzv-last-call 0 --rdzv-timeout 60 "
                           "--master-port " + std::to_string(free_port()) + " --node-rank ";
  const std::string job = " -- " + kBin + "/meshtrain --model gpt --steps 30 --eval-problems 0 --log-every 10";
  const std::string log = "/tmp/meshrun-waiting-" + std::to_string(getpid()) + ".log";
  Shell r = sh("(" + node + "0" + job + " > " + log + " 2>&1; echo node0 rc $? >> " + log + ") & " +
               "for i in $(seq 200); do grep -q 'round 0' " + log + " && break; sleep 0.05; done; " + node + "1" +
               job + " 2>&1; echo node1 rc $?; wait; cat " + log);
  std::remove(log.c_str());
  EXPECT_TRUE(contains(r.output, "meshrun: round 0: nodes 0, 1 ranks")) << r.output;
  EXPECT_TRUE(contains(r.output, "this node 1 joins at the job's next checkpoint")) << r.output;
  EXPECT_TRUE(contains(r.output, "warning: an elastic job without --save-dir")) << r.output;
  EXPECT_TRUE(contains(r.output, "meshrun: the job finished before this node could join")) << r.output;
  EXPECT_TRUE(contains(r.output, "node1 rc 0")) << r.output;
  EXPECT_TRUE(contains(r.output, "node0 rc 0")) << r.output;
}

// A node that dies while it waits to join no longer counts as waiting: the
// running ranks do not stop at their next checkpoint for it.
TEST(Meshrun, ElasticNodeThatDiesWhileWaitingIsNotWaitedFor) {
  char tmpl[] = "/tmp/meshrun-waiter-XXXXXX";
  const std::string dir = mkdtemp(tmpl);
  const std::string node = "MESHTRAIN_RDZV_TOKEN=0123456789abcdef0123456789abcdef " + kBin +
                           "/meshrun --nnodes 1:2 --nproc-per-node 1 --rdzv-last-call 0 --rdzv-timeout 60 "
                           "--master-port " + std::to_string(free_port()) + " --node-rank ";
  const std::string job = " -- " + kBin + "/meshtrain --model gpt --layers 1 --hidden 32 --seq-len 16 --global-batch 8 --steps 200 --eval-problems 0 "
                          "--log-every 100 "
                          "--save-dir " + dir + "/ckpt --save-every 100 --resume";
  Shell r = sh("cd " + dir + "; (" + node + "0" + job + " > node0.log 2>&1; echo node0 rc $? >> node0.log) & " +
               "until grep -q 'round 0' node0.log; do sleep 0.05; done; " + node + "1" + job + " > node1.log 2>&1 & " +
               "until grep -q 'joins at the job' node1.log; do sleep 0.02; done; kill -9 $!; wait; cat node0.log node1.log");
  std::system(("rm -rf " + dir).c_str());
  EXPECT_TRUE(contains(r.output, "this node 1 joins at the job's next checkpoint")) << r.output;
  EXPECT_FALSE(contains(r.output, "a node is waiting to join")) << r.output;
  EXPECT_FALSE(contains(r.output, "round 1")) << r.output;
  EXPECT_TRUE(contains(r.output, "node0 rc 0")) << r.output;
}

// A node whose store is not up yet keeps connecting until --rdzv-timeout; a
// SIGTERM then (a scheduler cancelling the job) used to wait for that. meshrun
// now ends within a second of it, saying where it was (Note [Signals while
// blocked] in src/launch/launcher.cpp).
TEST(Meshrun, SigtermWhileConnectingToTheStoreEndsWithinASecond) {
  const int port = free_port();  // nothing listens there: the connection is refused and retried
  Shell r = sh(str_cat("(", kBin, "/meshrun --nnodes 2 --node-rank 1 --nproc-per-node 1 --master-addr 127.0.0.1 ",
                       "--master-port ", port, " --rdzv-timeout 300 -- sleep 100 & pid=$!; sleep 2; ",
                       "a=$(date +%s.%N); kill -TERM $pid; wait $pid; echo \"exit $?\"; ",
                       "awk -v a=$a -v b=$(date +%s.%N) 'BEGIN { print \"took \" b - a }')"));
  EXPECT_TRUE(contains(r.output, "exit 143")) << r.output;
  EXPECT_TRUE(contains(r.output, "received signal Terminated while blocked")) << r.output;
  const size_t at = r.output.find("took ");
  ASSERT_NE(at, std::string::npos) << r.output;
  EXPECT_LT(std::stod(r.output.substr(at + 5)), 1.5) << r.output;  // a second, and the watchdog's 50 ms ticks
}
