// meshrun end to end: environment, prefixed output, failure propagation,
// restarts, no orphans, and two meshrun "nodes" forming one group on loopback.

#include <gtest/gtest.h>
#include <arpa/inet.h>
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

#include "comm/store.h"
#include "app/launch/launcher.h"
#include "util/files.h"
#include "meshtrain/util.h"
#include "meshtrain/version.h"
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

namespace {

// meshrun on node `rank` of 2 on loopback port `port`, with `flags` (its
// token file among them, or none: the environment's token is dropped).
std::string node(int rank, const std::string& port, const std::string& flags, const std::string& program = "true") {
  return str_cat("env -u MESHTRAIN_RDZV_TOKEN ", kBin, "/meshrun --node-rank ", rank,
                 " --master-addr 127.0.0.1 --master-port ", port, " ", flags, " -- ", program);
}

// Runs node 1's command in the background and node 0's in the foreground; the
// output is node 0's, "node 0 exit N", then node 1's and "node 1 exit N".
Shell two_nodes(const TempDir& dir, const std::string& port, const std::string& node0, const std::string& node1) {
  const std::string log1 = dir.file("node1-" + port + ".log");
  return sh("(" + node1 + " > " + log1 + " 2>&1; echo node 1 exit $? >> " + log1 + ") & " + node0 +
            " 2>&1; echo node 0 exit $?; wait; cat " + log1);
}

// A frame of the store's protocol (store_protocol.h): a command byte, then
// each field as a 64-bit length and its bytes.
std::string store_frame(uint8_t command, const std::vector<std::string>& fields = {}) {
  std::string body(1, static_cast<char>(command));
  for (const std::string& field : fields) {
    const int64_t n = static_cast<int64_t>(field.size());
    body.append(reinterpret_cast<const char*>(&n), 8);
    body += field;
  }
  const uint32_t len = static_cast<uint32_t>(body.size());
  return std::string(reinterpret_cast<const char*>(&len), 4) + body;
}

// What a stranger can send to a store without the token: connects to
// 127.0.0.1:port (waiting up to 20 s for it to listen), sends `bytes` right
// after the greeting and reads until the store closes the connection.
bool knock(int port, const std::string& bytes) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (std::chrono::steady_clock::now() < deadline) {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(port));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0) {
      char buf[4096];
      if (recv(fd, buf, sizeof buf, 0) <= 0 || send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL) < 0) {
        close(fd);
        return false;
      }
      while (recv(fd, buf, sizeof buf, 0) > 0) {
      }
      close(fd);
      return true;
    }
    close(fd);
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return false;
}

}  // namespace

// Issue 54, item 5 (Note [Token mismatch]): a stranger's unauthenticated
// kDecline (5 bytes), a kAuth with a wrong MAC, or a request before proving
// the token, sent to node 0's store while it waits for node 1, used to make
// node 0 quit within 0.2 s (and the real node 1 then failed 31 s later, naming
// nothing). They are logged and dropped, node 0 says them, and the job runs.
TEST(Meshrun, StrangerFramesWhileTheNodesMeetAreLoggedAndDropped) {
  TempDir dir;
  std::ofstream(dir.file("token")) << "0123456789abcdef0123456789abcdef\n";
  const int port = free_port();
  const std::string flags = "--nnodes 2 --nproc-per-node 1 --rdzv-timeout 60 --rdzv-token-file " + dir.file("token");
  const std::string log0 = dir.file("node0.log"), helper = kBin + "/meshrun_helper allreduce";
  std::system(("(" + node(0, std::to_string(port), flags, helper) + " > " + log0 + " 2>&1; echo node 0 exit $? >> " +
               log0 + ") &").c_str());
  const std::string mac(32, 'x');
  EXPECT_TRUE(knock(port, store_frame(11)));  // kDecline
  EXPECT_TRUE(knock(port, store_frame(10, {mac})));  // kAuth, a wrong MAC
  EXPECT_TRUE(knock(port, store_frame(9, {"g0/r0", "forged"})));  // kReport before proving anything
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));  // node 0 used to have quit by now
  const Shell r1 = sh(node(1, std::to_string(port), flags, helper));
  for (int i = 0; i < 200 && !contains(meshtrain::files::read_all(log0), "node 0 exit"); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  const std::string out0 = meshtrain::files::read_all(log0);
  EXPECT_EQ(r1.exit_code, 0) << r1.output << "\nnode 0:\n" << out0;
  EXPECT_TRUE(contains(out0, "node 0 exit 0")) << out0;
  EXPECT_TRUE(contains(out0, "rank 0 of 2 sum 3")) << out0;
  EXPECT_TRUE(contains(r1.output, "rank 1 of 2 sum 3")) << r1.output;
  for (const char* said : {"while waiting for the other nodes: the store refused a process at 127.0.0.1:",
                           "(it came with no rendezvous token, and this job has one)",
                           "(it came with another rendezvous token than this job's)",
                           "not acted on, since it proved no token"})
    EXPECT_TRUE(contains(out0, said)) << said << "\n" << out0;
}

// Issue 31, item 6, revised by issue 54, item 5 (Note [Token mismatch]): a
// node whose token is not node 0's, or that has none, is refused and says so
// at once, naming its token file and the fix; node 0 says the refusal and
// waits on (it proved nothing), and its time-out names it. A node with a
// token where node 0 has none is served, and the settings the nodes compare
// (Note [Nodes agree]) stop both at once.
TEST(Meshrun, NodesWithoutTheSameTokenAreNamedOnEveryNode) {
  TempDir dir;
  std::ofstream(dir.file("a")) << "0123456789abcdef0123456789abcdef\n";
  std::ofstream(dir.file("b")) << "fedcba9876543210fedcba9876543210\n";
  struct Case {
    std::string node0, node1, says0, says1;
  };
  const std::vector<Case> cases = {
      {"a", "b", "(it came with another rendezvous token than this job's)",
       "refused this process's rendezvous token (--rdzv-token-file " + dir.file("b") + ")"},
      {"a", "", "(it came with no rendezvous token, and this job has one)",
       "requires a rendezvous token and this process has none"},
  };
  for (const Case& c : cases) {
    const std::string port = std::to_string(free_port());
    auto flags = [&](const std::string& token, const std::string& timeout) {
      return str_cat("--nnodes 2 --nproc-per-node 1 --rdzv-timeout ", timeout,
                     token.empty() ? "" : " --rdzv-token-file " + dir.file(token));
    };
    const Shell r = two_nodes(dir, port, node(0, port, flags(c.node0, "4")),
                              "sleep 0.5; " + node(1, port, flags(c.node1, "60")));
    EXPECT_TRUE(contains(r.output, "node 0 exit 2")) << r.output;
    EXPECT_TRUE(contains(r.output, "node 1 exit 2")) << r.output;
    EXPECT_TRUE(contains(r.output, "meshrun: while waiting for the other nodes: the store refused a process at "
                                   "127.0.0.1:")) << r.output;
    EXPECT_TRUE(contains(r.output, "meshrun: timed out waiting for the other nodes (1 of 2 nodes arrived)")) << r.output;
    EXPECT_TRUE(contains(r.output, "; meanwhile the store refused a process at 127.0.0.1:")) << r.output;
    EXPECT_TRUE(contains(r.output, c.says0)) << r.output;
    EXPECT_TRUE(contains(r.output, c.says1)) << r.output;
    EXPECT_LT(r.seconds, 15.0) << r.output;
  }
  const std::string port = std::to_string(free_port());
  const Shell r = two_nodes(dir, port, node(0, port, "--nnodes 2 --rdzv-timeout 60"),
                            node(1, port, "--nnodes 2 --rdzv-timeout 60 --rdzv-token-file " + dir.file("b")));
  EXPECT_TRUE(contains(r.output, "node 0 exit 2")) << r.output;
  EXPECT_TRUE(contains(r.output, "node 1 exit 2")) << r.output;
  const std::string says = "node 1's meshrun has a rendezvous token (--rdzv-token-file " + dir.file("b") +
                           ") and node 0's has no rendezvous token: give every node the same --rdzv-token-file";
  EXPECT_TRUE(contains(r.output, "meshrun: stopped waiting for the other nodes: " + says)) << r.output;
  EXPECT_TRUE(contains(r.output, "\nmeshrun: " + says)) << r.output;
  EXPECT_LT(r.seconds, 15.0) << r.output;
}

// Issue 54, item 6 (Note [Nodes agree]): nodes whose meshrun flags differ
// used to train together (--nnodes 3 with a node 0 of 2) or fail after 304 s
// asking whether WORLD_SIZE was the same (--nproc-per-node 2 and 1). Every
// node now stops within seconds, naming the node, the flag, both values and
// the fix; an elastic node 0 says it and goes on.
TEST(Meshrun, NodesStartedWithOtherFlagsAreNamedOnEveryNodeWithinSeconds) {
  TempDir dir;
  struct Case {
    std::string node0, node1, says;
  };
  const std::vector<Case> cases = {
      {"--nnodes 2 --nproc-per-node 2", "--nnodes 2 --nproc-per-node 1",
       "node 1's meshrun has --nproc-per-node 1 and node 0's has --nproc-per-node 2: start every node's meshrun with "
       "the same --nproc-per-node"},
      {"--nnodes 2", "--nnodes 3", "node 1's meshrun has --nnodes 3 and node 0's has --nnodes 2"},
      {"--nnodes 2", "--nnodes 1:2", "node 1's meshrun has --nnodes 1:2 and node 0's has --nnodes 2"},
      {"--nnodes 2 --max-restarts 1", "--nnodes 2", "node 1's meshrun has --max-restarts 0 and node 0's has "
       "--max-restarts 1: start every node's meshrun with the same --max-restarts"},
  };
  for (const Case& c : cases) {
    const std::string port = std::to_string(free_port());
    const Shell r = two_nodes(dir, port, node(0, port, c.node0 + " --rdzv-timeout 60"),
                              node(1, port, c.node1 + " --rdzv-timeout 60"));
    EXPECT_TRUE(contains(r.output, "node 0 exit 2")) << r.output;
    EXPECT_TRUE(contains(r.output, "node 1 exit 2")) << r.output;
    EXPECT_TRUE(contains(r.output, "meshrun: stopped waiting for the other nodes: " + c.says)) << r.output;
    EXPECT_TRUE(contains(r.output, "\nmeshrun: " + c.says)) << r.output;
    EXPECT_LT(r.seconds, 15.0) << r.output;
  }
  // An elastic node 0 (MIN 1) says it and trains on alone: the node may come back with the right flags.
  const std::string port = std::to_string(free_port());
  const Shell r = two_nodes(dir, port, node(0, port, "--nnodes 1:2 --rdzv-last-call 3 --rdzv-timeout 60"),
                            node(1, port, "--nnodes 2 --rdzv-timeout 60"));
  EXPECT_TRUE(contains(r.output, "node 0 exit 0")) << r.output;
  EXPECT_TRUE(contains(r.output, "node 1 exit 2")) << r.output;
  EXPECT_TRUE(contains(r.output, "a node refused itself: node 1's meshrun has --nnodes 2 and node 0's has --nnodes "
                                 "1:2")) << r.output;
}

// meshtrain's version is among the settings (Note [Nodes agree]): node 1
// meets a node 0 whose settings say another version (this test's store plays
// node 0's meshrun with node_settings' own record) and refuses itself, naming both.
TEST(Meshrun, ANodeOfAnotherVersionIsNamed) {
  const std::string token = "0123456789abcdef0123456789abcdef";
  meshtrain::comm::StoreServer server("127.0.0.1", 0, token);
  meshtrain::comm::TcpStore store("127.0.0.1", server.port(), std::chrono::seconds(10), token);
  meshtrain::launch::LaunchOptions o = meshtrain::launch::parse_launch_args({"--nnodes", "2", "--", "true"});
  o.rdzv_token = token;
  std::string settings = meshtrain::launch::node_settings(o);
  settings.replace(settings.find("version\t"), std::string::npos, "version\t0.0.1\tmeshtrain 0.0.1\n");
  store.set("meshrun/settings", settings);
  TempDir dir;
  std::ofstream(dir.file("token")) << token << "\n";
  const Shell r = sh(node(1, std::to_string(server.port()), "--nnodes 2 --rdzv-timeout 20 --rdzv-token-file " +
                                                           dir.file("token")));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, str_cat("node 1's meshrun has meshtrain ", meshtrain::version(), " and node 0's has "
                                         "meshtrain 0.0.1: install the same meshtrain version on every node")))
      << r.output;
  EXPECT_TRUE(store.check("meshrun/nodes_differ"));
}

// Issue 54, item 7 (Note [Start-up reports] in src/comm/process.cpp): a
// process started by hand with the job's token and a rank meshrun's ranks
// hold posts its start-up error into their store while they train; neither
// meshrun nor the ranks, past their rendezvous, stop for it. (A guard: the old
// code posted no such reports.)
TEST(Meshrun, AStartupReportFromOutsideDoesNotStopARunningJob) {
  TempDir dir;
  std::ofstream(dir.file("token")) << "0123456789abcdef0123456789abcdef\n";
  const std::string port = std::to_string(free_port());
  const std::string log = dir.file("job.log");
  const std::string stranger = "env MESHTRAIN_RDZV_TOKEN=0123456789abcdef0123456789abcdef RANK=1 WORLD_SIZE=2 "
                               "MASTER_ADDR=127.0.0.1 MASTER_PORT=" + port + " timeout 20 " + kHelper + " allreduce";
  const Shell r = sh("(" + kBin + "/meshrun --master-port " + port + " --nproc-per-node 2 --rdzv-token-file " +
                     dir.file("token") + " -- " + kHelper + " hold > " + log + " 2>&1; echo job exit $? >> " + log +
                     ") & for i in $(seq 200); do [ $(grep -c joined " + log + ") = 2 ] && break; sleep 0.05; done; " +
                     stranger + "; echo \"extra process: exit $?\"; wait; cat " + log);
  EXPECT_TRUE(contains(r.output, "rank 1 has already joined the store")) << r.output;
  EXPECT_TRUE(contains(r.output, "extra process: exit 1")) << r.output;
  EXPECT_TRUE(contains(r.output, "meshtrain: ignored a start-up report (global rank 1 stopped at start-up: ")) << r.output;
  EXPECT_TRUE(contains(r.output, "job exit 0")) << r.output;
  EXPECT_TRUE(contains(r.output, "[rank1]: rank 1 of 2 sum 3")) << r.output;
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
  for (const char* flag : {"--data", "--async-save", "--zero", "--pp", "--clip-grad-norm", "--peak-tflops"})
    EXPECT_TRUE(contains(r.output, flag)) << flag << "\n" << r.output;
  // and the commands beside training, each of which answers its own --help
  for (const char* command : {"plan", "data", "export", "generate"}) {
    EXPECT_TRUE(contains(r.output, std::string("meshtrain ") + command + " [flags]")) << command << "\n" << r.output;
    const Shell own = sh(kBin + "/meshtrain " + command + " --help 2>&1");
    EXPECT_EQ(own.exit_code, 0) << command << ": " << own.output;
  }
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
// blocked] in app/launch/launcher.cpp).
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
