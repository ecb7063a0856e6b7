// Failure is loud and fast, on every backend: dead peers, stuck peers,
// mismatched arguments and bad arguments all end in an error that names the
// rank and the operation. Under mpirun a dead rank ends the whole job instead
// (MpiJob below).

#include <gtest/gtest.h>
#include <signal.h>
#include <torch/torch.h>
#include <unistd.h>

#include <dirent.h>
#include <sys/wait.h>

#include <chrono>
#include <fstream>
#include <thread>

#include "harness.h"
#include "meshtrain/comm.h"
#include "meshtrain/util.h"
#include "meshtrain/zero.h"

using meshtrain::ConfigError;
using meshtrain::comm::Communicator;
using meshtrain::comm::MismatchError;
using meshtrain::comm::PeerFailure;
using meshtrain::comm::ReduceOp;
using meshtrain::comm::TimeoutError;
using meshtrain::testing::RankOptions;
using meshtrain::testing::run_ranks;
using Clock = std::chrono::steady_clock;

namespace {

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

class Failures : public ::testing::TestWithParam<const char*> {
 protected:
  RankOptions options() const {
    RankOptions o;
    o.env.push_back(std::string("MESHTRAIN_BACKEND=") + GetParam());
    return o;
  }
};
class Split : public Failures {};
// The backends on which a dead peer is an error the survivors see (not mpi).
class PeerDeath : public Failures {};
// The backends that name a stuck rank at the end of a waits-for chain (not mpi).
class WaitChain : public Failures {};

bool alive(int pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string pid_field, name, state;
  if (!(stat >> pid_field >> name >> state)) return false;
  return state != "Z" && state != "X";  // a zombie is dead, only not yet reaped
}

// Shared-memory segment names in /dev/shm created by process `pid`.
std::vector<std::string> segments_of(int pid) {
  std::vector<std::string> names;
  const std::string prefix = "meshtrain-" + std::to_string(pid) + "-";
  if (DIR* dir = opendir("/dev/shm")) {
    while (dirent* e = readdir(dir)) {
      if (std::string(e->d_name).rfind(prefix, 0) == 0) names.push_back(e->d_name);
    }
    closedir(dir);
  }
  return names;
}

// One rank is SIGKILLed while all ranks loop on large all-reduces (on shm,
// most likely while it writes into the segment): every survivor raises
// PeerFailure naming it within 2 s (the timeout is 60 s, so only failure
// detection can explain a fast error). No segment outlives the group.
TEST_P(PeerDeath, DeadPeerMidCollectiveIsNamedWithinSeconds) {
  RankOptions options = this->options();
  options.comm_timeout = std::chrono::seconds(60);
  options.may_die = {1};
  auto run = run_ranks(3, [](Communicator& comm) {
    std::ofstream(meshtrain::testing::shared_dir() + "/pid" + std::to_string(comm.rank())) << getpid();
    auto t = torch::ones({1 << 20});
    comm.all_reduce(t);  // everyone is up
    if (comm.rank() == 1) {
      std::thread([] {
        std::this_thread::sleep_for(std::chrono::milliseconds(200));
        kill(getpid(), SIGKILL);
      }).detach();
    }
    const auto t0 = Clock::now();
    try {
      for (int i = 0; i < 100000; ++i) comm.all_reduce(t);
      ADD_FAILURE() << "all_reduce kept working after rank 1 was killed";
    } catch (const PeerFailure& e) {
      const double elapsed = seconds_since(t0);
      EXPECT_EQ(e.rank(), 1) << e.what();
      EXPECT_NE(std::string(e.what()).find("rank 1"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("all_reduce"), std::string::npos) << e.what();
      EXPECT_LT(elapsed, 2.0) << "took " << elapsed << " s: " << e.what();
      std::cout << "rank " << comm.rank() << " after " << elapsed << " s: " << e.what() << "\n";
    }
    // The communicator refuses further work with the original cause.
    EXPECT_THROW(comm.all_reduce(t), meshtrain::comm::CommError);
  }, options);
  if (meshtrain::testing::in_rank_process()) return;
  for (int r = 0; r < 3; ++r) {
    int pid = 0;
    std::ifstream(run.file("pid" + std::to_string(r))) >> pid;
    ASSERT_GT(pid, 0) << "rank " << r << " did not report its pid";
    EXPECT_TRUE(segments_of(pid).empty()) << "rank " << r << " left /dev/shm/" << segments_of(pid)[0];
  }
}

// Note [Roles live until exit]: a rank whose fully sharded module (its roles
// hold the pair's communicator) finished first and left is not reported dead
// to the ranks still working, even in a group without it: they pass the time
// it takes to leave and reduce among themselves. (Before the harness forgot
// the roles, ranks 2 and 3 were told "global rank 0 died".)
TEST_P(PeerDeath, ARankThatFinishesFirstWithShardedModulesIsNotReportedDead) {
  run_ranks(4, [](Communicator& comm) {
    const int r = comm.rank();
    auto pair = comm.split(r / 2, r, "pair");
    torch::manual_seed(0);
    torch::nn::Linear layer(3, 5);
    meshtrain::zero::fully_shard(*layer, pair);
    const float sum = layer->forward(torch::ones({2, 3})).sum().item<float>();
    layer = nullptr;  // the model is gone; its roles are not
    if (r < 2) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(1500));  // ranks 0 and 1 have left
    torch::Tensor t = torch::full({4}, sum * r);
    pair->all_reduce(t);
    EXPECT_TRUE(torch::allclose(t, torch::full({4}, sum * 5)));
  }, options());
}

// A segment name left by a job killed inside the rendezvous window (its
// creator is gone) is removed by the next job on the host.
TEST(SharedMemory, StaleSegmentsOfDeadProcessesAreRemoved) {
  int dead_pid = 0;
  std::string stale;
  if (!meshtrain::testing::in_rank_process()) {
    const pid_t child = fork();
    if (child == 0) _exit(0);
    waitpid(child, nullptr, 0);
    dead_pid = child;
    stale = "/dev/shm/meshtrain-" + std::to_string(dead_pid) + "-0";
    std::ofstream(stale) << "left by a killed job";
    ASSERT_EQ(segments_of(dead_pid).size(), 1u);
  }
  RankOptions options;
  options.env.push_back("MESHTRAIN_BACKEND=shm");
  run_ranks(2, [](Communicator& comm) {
    auto t = torch::ones({4});
    comm.all_reduce(t);
  }, options);
  if (!meshtrain::testing::in_rank_process()) {
    EXPECT_TRUE(segments_of(dead_pid).empty()) << stale;
  }
}

// Under mpirun a rank's death ends the whole job: mpirun sees the rank exit
// and kills the others, so survivors never get to raise PeerFailure (as they
// do on shm and gloo, DeadPeerMidCollectiveIsNamedWithinSeconds). What holds
// instead: mpirun exits with an error within seconds of the death, and no
// rank process is left behind.
TEST(MpiJob, KilledRankEndsTheJobWithinSeconds) {
  RankOptions options;
  options.env.push_back("MESHTRAIN_BACKEND=mpi");
  options.comm_timeout = std::chrono::seconds(60);
  options.time_limit = std::chrono::seconds(60);
  options.may_die = {0, 1, 2};  // 1 kills itself, mpirun ends 0 and 2
  auto run = run_ranks(3, [](Communicator& comm) {
    std::ofstream(meshtrain::testing::shared_dir() + "/pid" + std::to_string(comm.rank())) << getpid();
    auto t = torch::ones({1 << 20});
    comm.all_reduce(t);  // everyone is up
    if (comm.rank() == 1) {
      std::thread([] {
        std::this_thread::sleep_for(std::chrono::milliseconds(200));
        const auto now = std::chrono::system_clock::now().time_since_epoch();
        std::ofstream(meshtrain::testing::shared_dir() + "/killed_at")
            << std::chrono::duration_cast<std::chrono::milliseconds>(now).count() << std::endl;
        kill(getpid(), SIGKILL);
      }).detach();
    }
    const auto t0 = Clock::now();
    while (seconds_since(t0) < 30) comm.all_reduce(t);
    ADD_FAILURE() << "rank " << comm.rank() << " ran all_reduce for 30 s after rank 1 was killed";
  }, options);
  if (meshtrain::testing::in_rank_process()) return;
  const int status = run.launcher_status();
  EXPECT_FALSE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "mpirun succeeded though rank 1 was killed";
  long long killed_ms = 0;
  std::ifstream(run.file("killed_at")) >> killed_ms;
  ASSERT_GT(killed_ms, 0) << "rank 1 did not record when it died";
  const auto ended = std::chrono::duration_cast<std::chrono::milliseconds>(run.ended().time_since_epoch()).count();
  EXPECT_LT(ended - killed_ms, 5000) << "mpirun took " << ended - killed_ms << " ms to end the job";
  std::cout << "mpirun ended the job " << ended - killed_ms << " ms after rank 1 was killed\n";
  for (int r = 0; r < 3; ++r) {
    int pid = 0;
    std::ifstream(run.file("pid" + std::to_string(r))) >> pid;
    ASSERT_GT(pid, 0) << "rank " << r << " did not record its pid";
    for (int i = 0; i < 100 && alive(pid); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    EXPECT_FALSE(alive(pid)) << "rank " << r << " (pid " << pid << ") outlived mpirun";
  }
}

// A stopped (SIGSTOP) rank keeps its connections open: the others raise
// TimeoutError at the communicator's timeout, naming the operation. (Under
// mpirun too; the ranks that timed out then leave MPI without MPI_Finalize,
// and mpirun ends the job, the stopped rank included.)
TEST_P(Failures, StuckPeerGivesTimeoutError) {
  RankOptions options = this->options();
  options.comm_timeout = std::chrono::seconds(1);
  options.may_die = {2};
  run_ranks(3, [](Communicator& comm) {
    auto t = torch::ones({1000});
    comm.all_reduce(t);
    if (comm.rank() == 2) raise(SIGSTOP);
    const auto t0 = Clock::now();
    try {
      comm.all_reduce(t);
      ADD_FAILURE() << "all_reduce completed without rank 2";
    } catch (const TimeoutError& e) {
      const double elapsed = seconds_since(t0);
      EXPECT_GE(elapsed, 0.95);
      EXPECT_LT(elapsed, 10.0);
      EXPECT_NE(std::string(e.what()).find("all_reduce"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("communicator 'world'"), std::string::npos) << e.what();
      std::cout << "rank " << comm.rank() << " after " << elapsed << " s: " << e.what() << "\n";
    }
  }, options);
}

// Note [Naming a stuck rank]: rank 1 waits for rank 0, which waits for the
// stopped rank 2. Rank 1 times out first, yet it names rank 2, the end of the
// chain (rank 0's long wait is in the store), and so does rank 0.
TEST_P(WaitChain, TheFirstToTimeOutNamesTheEndOfTheChain) {
  RankOptions options = this->options();
  options.comm_timeout = std::chrono::seconds(3);
  options.may_die = {2};
  run_ranks(3, [](Communicator& comm) {
    auto t = torch::ones({4});
    comm.all_reduce(t);
    if (comm.rank() == 2) raise(SIGSTOP);
    try {
      if (comm.rank() == 1) comm.recv(t, 0);  // waits from now: the first to time out
      std::this_thread::sleep_for(std::chrono::milliseconds(500));
      comm.recv(t, 2);  // rank 0
      ADD_FAILURE() << "a receive completed from a stopped rank";
    } catch (const TimeoutError& e) {
      EXPECT_NE(std::string(e.what()).find("global rank 2"), std::string::npos) << e.what();
      if (comm.rank() == 1) {
        EXPECT_NE(std::string(e.what()).find("which waits for global rank 2"), std::string::npos) << e.what();
      }
    }
  }, options);
}

// Each case on a fresh communicator split from the world (one that raised
// MismatchError refuses further work), all in one job: an mpirun job costs
// ~1 s to start.
TEST_P(Failures, MismatchedDtypeShapeOrKindRaisesOnEveryRank) {
  run_ranks(3, [](Communicator& world) {
    const int r = world.rank();
    // Ranks 0 and 1 (collective over the world: rank 2 gets nullptr).
    auto pair = [&](const char* label) { return world.split(r < 2 ? 0 : -1, r, label); };
    {
      auto comm = world.split(0, r, "dtype");
      // dtype differs on rank 1
      auto a = r == 1 ? torch::ones({4}, torch::kFloat64) : torch::ones({4}, torch::kFloat32);
      try {
        comm->all_reduce(a);
        ADD_FAILURE() << "no error for a dtype mismatch";
      } catch (const MismatchError& e) {
        EXPECT_NE(std::string(e.what()).find("rank 1 passed Double[4]"), std::string::npos) << e.what();
      }
    }
    if (auto comm = world.split(r >= 1 ? 0 : -1, r, "group")) {  // a group's rank 1 is the job's rank 2
      auto a = r == 2 ? torch::ones({4}, torch::kFloat64) : torch::ones({4}, torch::kFloat32);
      try {
        comm->all_reduce(a);
        ADD_FAILURE() << "no error for a dtype mismatch";
      } catch (const MismatchError& e) {
        EXPECT_NE(std::string(e.what()).find("rank 1 (global rank 2) passed Double[4]"), std::string::npos) << e.what();
      }
    }
    if (auto comm = pair("shape")) {
      auto b = r == 0 ? torch::ones({2, 3}) : torch::ones({3, 2});
      EXPECT_THROW(comm->all_reduce(b), MismatchError);
    }
    if (auto comm = pair("path")) {
      // One rank's tensor takes the small-message path, the other's the large one.
      auto b = torch::ones({r == 0 ? 4 : 1 << 20});
      EXPECT_THROW(comm->all_reduce(b), MismatchError);
    }
    // `call` on a fresh pair must raise MismatchError naming `expected` on both ranks.
    auto expect_mismatch = [&](const char* label, const std::function<void(Communicator&)>& call,
                               const std::string& expected) {
      auto comm = pair(label);
      if (!comm) return;
      try {
        call(*comm);
        ADD_FAILURE() << "no error for " << label;
      } catch (const MismatchError& e) {
        EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << e.what();
      }
    };
    expect_mismatch("kind", [&](Communicator& c) {
      auto t = torch::ones({5});
      if (r == 0) c.all_reduce(t); else c.broadcast(t, 0);
    }, "rank 1 called broadcast while rank 0 called all_reduce");
    // Payloads inline in the header round, larger than MPI's eager size: rank 0's
    // round message has a second part, rank 1's (a broadcast's receiver) none.
    expect_mismatch("inline kind", [&](Communicator& c) {
      auto t = torch::ones({1500});
      if (r == 0) c.all_gather(t); else c.broadcast(t, 0);
    }, "rank 1 called broadcast while rank 0 called all_gather");
    expect_mismatch("inline kind, both sending", [&](Communicator& c) {  // both ranks' round messages go in two
      auto t = torch::ones({1500});
      if (r == 0) c.all_reduce(t); else c.broadcast(t, 1);
    }, "rank 1 called broadcast while rank 0 called all_reduce");
    if (auto comm = pair("sizes")) {
      // reduce_scatter inputs of different sizes
      auto d = torch::ones({r == 0 ? 10 : 12});
      EXPECT_THROW(comm->reduce_scatter(d), MismatchError);
    }
    // Large buffers: on the TCP links their data leaves beside the header
    // round (Note [Verification beside the data]); a mismatch still raises
    // on both ranks, whichever rank's messages are the larger.
    expect_mismatch("large sizes", [&](Communicator& c) {
      auto big = torch::ones({r == 0 ? 100000 : 120000});
      c.all_reduce(big);
    }, "Float[120000]");
    expect_mismatch("large kind", [&](Communicator& c) {
      auto t = torch::ones({200000});
      if (r == 0) c.reduce_scatter(t); else c.broadcast(t, 1);
    }, "rank 1 called broadcast while rank 0 called reduce_scatter");
    if (auto comm = pair("p2p")) {
      // A receive into a tensor of another shape: the receiver raises. (A small
      // message was delivered whole, so the sender's send completes; a large
      // one would fail once the receiver has gone.)
      if (r == 0) {
        comm->send(torch::ones({8}), 1);
      } else {
        auto small = torch::zeros({4});
        EXPECT_THROW(comm->recv(small, 0), MismatchError);
      }
    }
  }, options());
}

// On four ranks Gloo's header round goes by recursive doubling for small and
// verifying collectives, directly for large ones (Note [Doubling round]):
// ranks in rounds of different patterns must all raise, none hang.
TEST_P(Failures, MismatchesOnFourRanksRaiseOnEveryRankWhateverTheRoundsPattern) {
  run_ranks(4, [](Communicator& world) {
    const int r = world.rank();
    auto expect_mismatch = [&](const char* label, const std::function<void(Communicator&)>& call,
                               const std::string& expected) {
      auto comm = world.split(0, r, label);
      auto t0 = Clock::now();
      try {
        call(*comm);
        ADD_FAILURE() << "no error for " << label;
      } catch (const MismatchError& e) {
        EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << label << ": " << e.what();
      }
      // At once: not after a wait for a peer that left (the failure watcher's 2 s).
      EXPECT_LT(seconds_since(t0), 1.5) << label;
    };
    expect_mismatch("dtype", [&](Communicator& c) {
      auto t = r == 3 ? torch::ones({4}, torch::kFloat64) : torch::ones({4});
      c.all_reduce(t);
    }, "rank 3 passed Double[4]");
    expect_mismatch("uneven all_gather, one dtype off", [&](Communicator& c) {
      auto t = r == 1 ? torch::ones({r + 1}, torch::kInt32) : torch::ones({r + 1});
      c.all_gather(t);
    }, "Int[2]");
    // Rank 0's all_reduce is large (its header round leaves beside its data),
    // the others' small; rank 1 calls another collective.
    expect_mismatch("large among small", [&](Communicator& c) {
      if (r == 1) {
        c.all_gather(torch::ones({8}));
      } else {
        auto t = torch::ones({r == 0 ? 100000 : 8});
        c.all_reduce(t);
      }
    }, "");
    expect_mismatch("barrier among broadcasts", [&](Communicator& c) {
      if (r == 3) {
        c.barrier();
      } else {
        auto t = torch::ones({200000});
        c.broadcast(t, 0);
      }
    }, "");
    expect_mismatch("reduce_scatter, two sizes", [&](Communicator& c) {
      auto t = torch::ones({r < 2 ? 400000 : 40});
      c.reduce_scatter(t);
    }, "");
  }, options());
}

TEST_P(Failures, BadArgumentsAreRejectedBeforeCommunication) {
  run_ranks(2, [](Communicator& comm) {
    auto t = torch::ones({4});
    EXPECT_THROW(comm.broadcast(t, 2), ConfigError);
    EXPECT_THROW(comm.reduce(t, -1), ConfigError);
    EXPECT_THROW(comm.send(t, comm.rank()), ConfigError);  // to self
    EXPECT_THROW(comm.all_reduce(torch::ones({3}, torch::kBool)), ConfigError);
    EXPECT_THROW(comm.all_reduce(torch::ones({3}, torch::kInt64), ReduceOp::kAvg), ConfigError);
    EXPECT_THROW(comm.reduce_scatter(torch::ones({10}), ReduceOp::kSum, {3, 3}), ConfigError);
    EXPECT_THROW(comm.all_gather_into(torch::zeros({3}), torch::ones({2})), ConfigError);
    // None of that reached the wire: the communicator still works.
    comm.all_reduce(t);
    EXPECT_TRUE(torch::equal(t, torch::full({4}, 2.0f)));
  }, options());
}

// Sub-communicators run collectives concurrently with their parent.
TEST_P(Split, ByColorAndByRankListConcurrentWithParent) {
  run_ranks(4, [](Communicator& comm) {
    const int r = comm.rank();
    auto parity = comm.split(r % 2, r, "parity");
    ASSERT_TRUE(parity);
    EXPECT_EQ(parity->size(), 2);
    EXPECT_EQ(parity->rank(), r / 2);
    EXPECT_EQ(parity->global_ranks(), (std::vector<int>{r % 2, r % 2 + 2}));
    auto pair = comm.split(std::vector<int>{3, 1}, "pair");  // rank 3 becomes 0
    EXPECT_EQ(static_cast<bool>(pair), r == 1 || r == 3);
    if (pair) {
      EXPECT_EQ(pair->rank(), r == 3 ? 0 : 1);
    }
    for (int i = 0; i < 20; ++i) {
      auto sub = torch::full({1000}, static_cast<float>(r));
      auto all = torch::full({1000}, static_cast<float>(r));
      auto w1 = parity->all_reduce_async(sub);
      auto w2 = comm.all_reduce_async(all);
      w1->wait();
      w2->wait();
      EXPECT_TRUE(torch::equal(sub, torch::full({1000}, static_cast<float>(r % 2 == 0 ? 0 + 2 : 1 + 3))));
      EXPECT_TRUE(torch::equal(all, torch::full({1000}, 6.0f)));
    }
    if (pair) {
      auto x = torch::full({3}, static_cast<float>(r));
      pair->broadcast(x, 0);
      EXPECT_TRUE(torch::equal(x, torch::full({3}, 3.0f)));
    }
  }, options());
}

INSTANTIATE_TEST_SUITE_P(Backends, Failures, ::testing::Values("shm", "gloo", "mpi"),
                         [](const auto& info) { return std::string(info.param); });
INSTANTIATE_TEST_SUITE_P(Backends, WaitChain, ::testing::Values("shm", "gloo"),
                         [](const ::testing::TestParamInfo<const char*>& info) { return std::string(info.param); });
INSTANTIATE_TEST_SUITE_P(Backends, PeerDeath, ::testing::Values("shm", "gloo"),
                         [](const auto& info) { return std::string(info.param); });
INSTANTIATE_TEST_SUITE_P(Backends, Split, ::testing::Values("shm", "gloo", "mpi"),
                         [](const auto& info) { return std::string(info.param); });

}  // namespace

namespace {

// A second world of the harness's ranks, through the harness's store, under
// the group "<harness group>-<suffix>" (for what a world's creation checks).
meshtrain::comm::CommPtr another_world(Communicator& world, const std::string& suffix,
                                       meshtrain::comm::CommOptions options = {}) {
  return meshtrain::comm::init_with_store("127.0.0.1", std::atoi(std::getenv("MESHTRAIN_HARNESS_PORT")), world.rank(),
                                          world.size(), std::string(std::getenv("MESHTRAIN_HARNESS_GROUP")) + "-" + suffix,
                                          std::move(options));
}

}  // namespace

// Note [Authenticated pairs]: with a token, every gloo pair proves it knows
// it. The world's pairs do (its all-reduce works); a communicator whose rank 1
// holds another token, as a stranger in a pair's place would, is refused on
// both ranks before any collective. (The harness's store takes any client, so
// only the pair proof can tell.)
TEST(GlooPairs, APairThatDoesNotKnowTheTokenIsRefused) {
  RankOptions o;
  o.env = {"MESHTRAIN_BACKEND=gloo", "MESHTRAIN_RDZV_TOKEN=0123456789abcdef0123456789abcdef"};
  run_ranks(2, [](Communicator& world) {
    auto t = torch::ones({2});
    world.all_reduce(t);
    EXPECT_EQ(t[0].item<float>(), 2.0f);
    if (world.rank() == 1) setenv("MESHTRAIN_RDZV_TOKEN", "fedcba9876543210fedcba9876543210", 1);
    try {
      another_world(world, "stranger");
      ADD_FAILURE() << "a pair with another token was accepted";
    } catch (const meshtrain::ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find(world.rank() == 0 ? "the connection of rank 1 (global rank 1) did not prove "
                                                                "it knows the job's token; refused"
                                                              : "the connection of rank 0 (global rank 0) did not prove"),
                std::string::npos)
          << e.what();
    }
  }, o);
}

// Issue 31, item 5 (Note [Backends agreed] in src/comm/backend.cpp): members
// asking for different backends used to build different transports and wait
// for each other until the communication timeout, naming neither (a /dev/shm
// segment left behind). Now both refuse at once, naming the backends.
TEST(Rendezvous, MembersAskingForDifferentBackendsAreRefusedAtOnce) {
  run_ranks(2, [](Communicator& world) {
    meshtrain::comm::CommOptions o;
    o.backend = world.rank() == 0 ? "shm" : "gloo";
    o.timeout = std::chrono::seconds(60);
    const auto start = Clock::now();
    try {
      another_world(world, "mixed", o);
      ADD_FAILURE() << "a communicator of shm and gloo members was made";
    } catch (const ConfigError& e) {
      const std::string expected = world.rank() == 0
                                       ? "global rank 1 asked for backend 'gloo' and this rank (global rank 0) for 'shm'"
                                       : "global rank 0 asked for backend 'shm' and this rank (global rank 1) for 'gloo'";
      EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("set the same MESHTRAIN_BACKEND"), std::string::npos) << e.what();
    }
    EXPECT_LT(Clock::now() - start, std::chrono::seconds(10));
  });
}

// Issue 31, item 6, for ranks (Note [Token mismatch] in app/launch/launcher.cpp):
// with a store that takes no token, a rank holding one would make its Gloo
// pairs prove it to a peer that does not and both would wait until the
// communication timeout. The rank that differs from rank 0 stops at once,
// naming the variable; rank 0 learns that it left.
TEST(Rendezvous, ARankWithATokenRank0LacksStopsAtOnce) {
  run_ranks(2, [](Communicator& world) {
    if (world.rank() == 1) setenv("MESHTRAIN_RDZV_TOKEN", "fedcba9876543210fedcba9876543210", 1);
    meshtrain::comm::CommOptions o;
    o.backend = "gloo";
    o.timeout = std::chrono::seconds(60);
    const auto start = Clock::now();
    try {
      another_world(world, "token", o);
      ADD_FAILURE() << "a world of a rank with a token and one without was made";
    } catch (const ConfigError& e) {
      EXPECT_EQ(world.rank(), 1) << e.what();
      EXPECT_NE(std::string(e.what()).find("rank 1 has a rendezvous token (MESHTRAIN_RDZV_TOKEN) and rank 0 has none"),
                std::string::npos)
          << e.what();
    } catch (const PeerFailure& e) {
      EXPECT_EQ(world.rank(), 0) << e.what();
      EXPECT_EQ(e.rank(), 1) << e.what();
    }
    EXPECT_LT(Clock::now() - start, std::chrono::seconds(10));
    unsetenv("MESHTRAIN_RDZV_TOKEN");
  });
}
