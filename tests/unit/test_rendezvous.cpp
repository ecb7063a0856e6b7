// Environment parsing, init strings and the store, without any communicator.

#include <gtest/gtest.h>

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <functional>
#include <map>
#include <thread>

#include "meshtrain/comm.h"
#include "comm/store.h"
#include "meshtrain/util.h"
#include "comm/socket.h"
#include "comm/store_protocol.h"

using namespace meshtrain;
using namespace meshtrain::comm;

namespace {

DistEnv parse(const std::map<std::string, std::string>& vars) {
  return parse_dist_env([&](const std::string& k) -> std::optional<std::string> {
    auto it = vars.find(k);
    if (it == vars.end()) return std::nullopt;
    return it->second;
  });
}

// The error names the variable.
void expect_error_naming(const std::map<std::string, std::string>& vars, const std::string& needle) {
  try {
    parse(vars);
    ADD_FAILURE() << "no error; expected one naming " << needle;
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

}  // namespace

TEST(DistEnv, TorchrunVariables) {
  auto e = parse({{"RANK", "3"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "2"},
                  {"MASTER_ADDR", "10.0.0.1"}, {"MASTER_PORT", "1234"}});
  EXPECT_EQ(e.source, "torchrun");
  EXPECT_EQ(e.rank, 3);
  EXPECT_EQ(e.world_size, 8);
  EXPECT_EQ(e.local_rank, 1);
  EXPECT_EQ(e.local_world_size, 2);
  EXPECT_EQ(e.master_addr, "10.0.0.1");
  EXPECT_EQ(e.master_port, 1234);
}

TEST(DistEnv, OpenMpiAndSlurmVariables) {
  auto m = parse({{"OMPI_COMM_WORLD_RANK", "2"}, {"OMPI_COMM_WORLD_SIZE", "4"},
                  {"OMPI_COMM_WORLD_LOCAL_RANK", "2"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"}});
  EXPECT_EQ(m.source, "openmpi");
  EXPECT_EQ(m.rank, 2);
  EXPECT_EQ(m.master_addr, "127.0.0.1");  // one node: loopback
  auto s = parse({{"SLURM_PROCID", "5"}, {"SLURM_NTASKS", "8"}, {"SLURM_LOCALID", "1"},
                  {"SLURM_NTASKS_PER_NODE", "4"}, {"SLURM_JOB_NODELIST", "gpu[07-08],cpu1"}});
  EXPECT_EQ(s.source, "slurm");
  EXPECT_EQ(s.rank, 5);
  EXPECT_EQ(s.master_addr, "gpu07");
  EXPECT_EQ(s.master_port, 29500);
  EXPECT_EQ(s.local_world_size, 4);
  // srun without --ntasks-per-node: 7 tasks on 3 nodes, 3 + 2 + 2; rank 6 is the second task of node 2.
  auto uneven = parse({{"SLURM_PROCID", "6"}, {"SLURM_NTASKS", "7"}, {"SLURM_LOCALID", "1"}, {"SLURM_NODEID", "2"},
                       {"SLURM_TASKS_PER_NODE", "3,2(x2)"}, {"SLURM_JOB_NODELIST", "n[1-3]"}});
  EXPECT_EQ(uneven.local_world_size, 2);
  EXPECT_EQ(uneven.local_rank, 1);
  EXPECT_EQ(meshtrain::comm::slurm_tasks_on_node("2(x3),1", 0), 2);
  EXPECT_EQ(meshtrain::comm::slurm_tasks_on_node("2(x3),1", 2), 2);
  EXPECT_EQ(meshtrain::comm::slurm_tasks_on_node("2(x3),1", 3), 1);
  EXPECT_THROW(meshtrain::comm::slurm_tasks_on_node("2(x3),1", 4), meshtrain::ConfigError);
  EXPECT_THROW(meshtrain::comm::slurm_tasks_on_node("2(x", 0), meshtrain::ConfigError);
  EXPECT_THROW(meshtrain::comm::slurm_tasks_on_node("two", 0), meshtrain::ConfigError);
}

TEST(DistEnv, NoVariablesMeansOneProcess) {
  auto e = parse({});
  EXPECT_EQ(e.source, "single");
  EXPECT_EQ(e.world_size, 1);
}

TEST(DistEnv, BadValuesNameTheVariable) {
  expect_error_naming({{"RANK", "4"}, {"WORLD_SIZE", "4"}}, "RANK=4");
  expect_error_naming({{"RANK", "0"}}, "WORLD_SIZE");
  expect_error_naming({{"RANK", "x"}, {"WORLD_SIZE", "2"}}, "RANK='x'");
  expect_error_naming({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "70000"}}, "MASTER_PORT");
  expect_error_naming({{"RANK", "0"}, {"WORLD_SIZE", "4"}, {"LOCAL_WORLD_SIZE", "2"}}, "MASTER_ADDR");
  expect_error_naming({{"RANK", "0"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "3"}, {"LOCAL_WORLD_SIZE", "2"},
                       {"MASTER_ADDR", "h"}}, "LOCAL_RANK=3");
  // Across nodes under mpirun, a backend that meets through the store needs MASTER_ADDR ...
  expect_error_naming({{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "4"},
                       {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}, {"MESHTRAIN_BACKEND", "gloo"}}, "MASTER_ADDR");
  // ... MPI (auto under mpirun, or mpi) needs no store.
  for (const char* backend : {"auto", "mpi"}) {
    auto e = parse({{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "4"},
                    {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}, {"MESHTRAIN_BACKEND", backend}});
    EXPECT_EQ(e.source, "openmpi") << backend;
  }
}

// Backend mpi without mpirun: a ConfigError naming the fix, before any communication.
TEST(DistEnv, MpiBackendWithoutMpirunIsAConfigError) {
  ASSERT_EQ(std::getenv("OMPI_COMM_WORLD_RANK"), nullptr) << "run the unit tests without mpirun";
  for (bool by_env : {true, false}) {
    if (by_env) setenv("MESHTRAIN_BACKEND", "mpi", 1);
    try {
      init_from_env(by_env ? CommOptions() : CommOptions().set_backend("mpi"));
      ADD_FAILURE() << "no error for backend mpi without mpirun";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("not started by mpirun"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("mpirun -np"), std::string::npos) << e.what();
    }
    unsetenv("MESHTRAIN_BACKEND");
  }
}

TEST(DistEnv, SlurmNodeLists) {
  EXPECT_EQ(first_host_of_nodelist("node01"), "node01");
  EXPECT_EQ(first_host_of_nodelist("node[001-004]"), "node001");
  EXPECT_EQ(first_host_of_nodelist("node[3,5-7],other[1-2]"), "node3");
  EXPECT_EQ(first_host_of_nodelist("a,b"), "a");
  EXPECT_EQ(first_host_of_nodelist("rack[2-3]-n1"), "rack2-n1");
  EXPECT_THROW(first_host_of_nodelist("node[1-3"), ConfigError);
}

TEST(InitMethod, TcpUrls) {
  EXPECT_EQ(parse_tcp_url("tcp://127.0.0.1:29500"), std::make_pair(std::string("127.0.0.1"), 29500));
  EXPECT_EQ(parse_tcp_url("tcp://[::1]:80"), std::make_pair(std::string("::1"), 80));
  EXPECT_EQ(parse_tcp_url("tcp://host.example:1"), std::make_pair(std::string("host.example"), 1));
  for (const char* bad : {"127.0.0.1:29500", "tcp://127.0.0.1", "tcp://:80", "tcp://h:0", "tcp://h:x",
                          "tcp://h:99999", "udp://h:1", "tcp://[::1]80"}) {
    EXPECT_THROW(parse_tcp_url(bad), ConfigError) << bad;
  }
}

TEST(Store, SetGetAddAndWait) {
  StoreServer server("127.0.0.1", 0);
  TcpStore a("127.0.0.1", server.port(), std::chrono::seconds(5));
  TcpStore b("127.0.0.1", server.port(), std::chrono::seconds(5));
  std::thread setter([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    b.set("k", std::string("v\0w", 3));
  });
  EXPECT_EQ(a.get("k"), std::string("v\0w", 3));  // waits for the setter
  setter.join();
  EXPECT_EQ(a.add("n", 5), 5);
  EXPECT_EQ(b.add("n", -2), 3);
  EXPECT_TRUE(a.check("n"));
  EXPECT_FALSE(a.check("absent"));
  PrefixStore p("job", std::make_shared<TcpStore>("127.0.0.1", server.port(), std::chrono::seconds(5)));
  p.set("x", "1");
  EXPECT_EQ(a.get("job/x"), "1");
}

TEST(Store, GetTimesOutNamingTheKey) {
  StoreServer server("127.0.0.1", 0);
  TcpStore a("127.0.0.1", server.port(), std::chrono::milliseconds(200));
  try {
    a.get("never");
    ADD_FAILURE();
  } catch (const TimeoutError& e) {
    EXPECT_NE(std::string(e.what()).find("'never'"), std::string::npos) << e.what();
  }
}

TEST(Store, ClosedConnectionWithoutByeIsPushedToWatchers) {
  StoreServer server("127.0.0.1", 0);
  std::mutex m;
  std::vector<FailureReport> seen;
  FailureWatcher watcher("127.0.0.1", server.port(), "g0/", std::chrono::seconds(5),
                         [&](const FailureReport& r) {
                           std::lock_guard<std::mutex> lock(m);
                           seen.push_back(r);
                         });
  {
    TcpStore polite("127.0.0.1", server.port(), std::chrono::seconds(5));
    polite.hello("g0/r0");
    polite.bye();
  }
  {
    TcpStore other_group("127.0.0.1", server.port(), std::chrono::seconds(5));
    other_group.hello("g1/r0");  // another attempt's label: not watched
  }
  {
    TcpStore dying("127.0.0.1", server.port(), std::chrono::seconds(5));
    dying.hello("g0/r3");
  }  // closes without bye, as a killed process would
  for (int i = 0; i < 200; ++i) {
    {
      std::lock_guard<std::mutex> lock(m);
      if (!seen.empty()) break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  std::lock_guard<std::mutex> lock(m);
  ASSERT_EQ(seen.size(), 1u);
  EXPECT_EQ(seen[0].label, "g0/r3");
  EXPECT_EQ(server.failures().size(), 2u);  // g1/r0 recorded too, not pushed
}

TEST(Store, ServerBindsOnlyTheGivenAddressAndReportsTakenPorts) {
  StoreServer server("127.0.0.1", 0);
  try {
    StoreServer again("127.0.0.1", server.port());
    ADD_FAILURE() << "second server on a taken port";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("already in use"), std::string::npos) << e.what();
  }
  // 127.0.0.2 is loopback too, but the server did not bind it.
  EXPECT_THROW(TcpStore("127.0.0.2", server.port(), std::chrono::milliseconds(300)), TimeoutError);
}

namespace {

// A raw connection to the store, as a stranger (or a broken client) makes one.
int raw_connection(int port) {
  const int fd = net::connect_to("127.0.0.1", port, net::Clock::now() + std::chrono::seconds(5), "the store");
  timeval limit{5, 0};  // a store that neither answers nor closes fails the test, not hangs it
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &limit, sizeof limit);
  return fd;
}

// Whether the server resets or closes the connection within 10 s, without reading what it sent.
bool reset_by_server(int fd) {
  pollfd p{fd, POLLRDHUP, 0};
  return ::poll(&p, 1, 10000) == 1 && (p.revents & (POLLHUP | POLLERR | POLLRDHUP));
}

// Reads until the server closes the connection (true) or 5 s pass (false).
bool closed_by_server(int fd) {
  char buf[65536];
  ssize_t n;
  while ((n = recv(fd, buf, sizeof buf, 0)) > 0) {
  }
  return n == 0 || errno == ECONNRESET;  // a reset when it closed with our bytes unread
}

std::string message_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

}  // namespace

// Note [Store authentication]: with a token, only clients that know it are
// served; a stranger's request (here a forged failure report) is not handled.
TEST(Store, OnlyClientsWithTheTokenAreServed) {
  const std::string token = generate_rdzv_token();
  EXPECT_EQ(token.size(), 64u);
  EXPECT_NE(token, generate_rdzv_token());
  StoreServer server("127.0.0.1", 0, token);
  TcpStore member("127.0.0.1", server.port(), std::chrono::seconds(5), token);
  member.set("k", "v");
  EXPECT_EQ(member.get("k"), "v");
  const auto none = [&] { TcpStore("127.0.0.1", server.port(), std::chrono::seconds(5), ""); };
  EXPECT_NE(message_of(none).find("requires a rendezvous token and this process has none"), std::string::npos)
      << message_of(none);
  const auto wrong = [&] { TcpStore("127.0.0.1", server.port(), std::chrono::seconds(5), "another job's token"); };
  EXPECT_NE(message_of(wrong).find("refused this process's rendezvous token"), std::string::npos) << message_of(wrong);
  const auto watcher = [&] {
    FailureWatcher("127.0.0.1", server.port(), "g0/", std::chrono::seconds(5), [](const FailureReport&) {}, "wrong");
  };
  EXPECT_NE(message_of(watcher).find("refused"), std::string::npos) << message_of(watcher);

  const int fd = raw_connection(server.port());
  const std::string forged = net::Writer().u8(store_protocol::kReport).str("g0/r0").str("forged").bytes();
  ASSERT_TRUE(net::write_frame(fd, forged));
  EXPECT_TRUE(closed_by_server(fd));
  close(fd);
  EXPECT_TRUE(server.failures().empty());
  EXPECT_EQ(member.get("k"), "v");  // the members are served as before
}

// Issue 54, item 5 (Note [Token mismatch] in app/launch/launcher.cpp): what a
// client sends before it proved the token changes nothing. A kDecline, a
// wrong MAC and a request first are refused and recorded for the waiting
// lines (kRefusalsKey, the first five); no failure is reported, and no key but
// that one is set (a stranger's decline used to set the key the launchers
// stopped on).
TEST(Store, WhatAClientSaysBeforeProvingTheTokenChangesNothing) {
  const std::string token = "the job's token, 32 characters!";
  StoreServer server("127.0.0.1", 0, token);
  TcpStore member("127.0.0.1", server.port(), std::chrono::seconds(5), token);
  EXPECT_EQ(refusals_seen(member), "");
  const std::vector<std::string> frames = {
      net::Writer().u8(store_protocol::kDecline).bytes(),
      net::Writer().u8(store_protocol::kAuth).str(std::string(32, 'x')).bytes(),
      net::Writer().u8(store_protocol::kReport).str("g0/r0").str("forged").bytes(),
      net::Writer().u8(store_protocol::kHello).str("g0/r0").bytes(),
      net::Writer().u8(store_protocol::kDecline).bytes(),
      net::Writer().u8(store_protocol::kDecline).bytes(),
  };
  for (const std::string& frame : frames) {
    const int fd = raw_connection(server.port());
    ASSERT_TRUE(net::write_frame(fd, frame));
    EXPECT_TRUE(closed_by_server(fd));
    close(fd);
  }
  EXPECT_TRUE(server.failures().empty());
  const std::string seen = refusals_seen(member);
  EXPECT_EQ(seen.rfind("the store refused a process at 127.0.0.1:", 0), 0u) << seen;
  for (const char* what : {"(it came with no rendezvous token, and this job has one)",
                           "(it came with another rendezvous token than this job's)",
                           "(it sent a request before proving it knows the job's token)"}) {
    EXPECT_NE(seen.find(what), std::string::npos) << what << "\n" << seen;
  }
  EXPECT_EQ(std::count(seen.begin(), seen.end(), '('), 5) << "only the first five are kept: " << seen;
  EXPECT_FALSE(member.check("meshtrain/token_mismatch"));
}

// A length prefix of nearly 4 GiB is refused before any allocation, with or
// without a token; the store goes on serving.
TEST(Store, HugeFramesCloseTheConnection) {
  for (const std::string token : {"", "the job's token, 32 characters!"}) {
    StoreServer server("127.0.0.1", 0, token);
    TcpStore member("127.0.0.1", server.port(), std::chrono::seconds(5), token);
    const int fd = raw_connection(server.port());
    const uint32_t huge = 0xFFFFFFF0u;
    ASSERT_TRUE(net::write_all(fd, &huge, 4));
    net::write_all(fd, std::string(1 << 20, 'x').data(), 1 << 20);  // fails once the store has closed: it may
    EXPECT_TRUE(closed_by_server(fd)) << "token '" << token << "'";
    close(fd);
    member.set("still", "here");
    EXPECT_EQ(member.get("still"), "here");
  }
}

// A client that sends requests and never reads the replies used to block the
// store's only thread; now its replies queue (up to 64 MiB, then it is
// dropped) and everyone else is served meanwhile.
TEST(Store, AClientThatNeverReadsDoesNotStopTheStore) {
  StoreServer server("127.0.0.1", 0, "");
  TcpStore member("127.0.0.1", server.port(), std::chrono::seconds(5), "");
  member.set("big", std::string(64 << 10, 'v'));
  const int fd = raw_connection(server.port());
  std::string requests;
  for (int i = 0; i < 2000; ++i) requests += net::frame_of(net::Writer().u8(store_protocol::kGet).str("big").bytes());
  std::thread flood([&] { net::write_all(fd, requests.data(), requests.size()); });  // 128 MB of replies asked
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < 20; ++i) EXPECT_EQ(member.get("big").size(), 64u << 10);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(4));
  flood.join();
  EXPECT_TRUE(reset_by_server(fd));  // dropped past 64 MiB queued
  close(fd);
}
