// OpenMPI across the namespaced test hosts (issue 30, item 3a). Each case
// starts four processes and a one-process reference (about a minute on a
// loaded 2-core machine), so they run with `ctest -L cluster`, not in the
// default suite (label full).
#include <gtest/gtest.h>

#include <ostream>
#include <string>

#include "../dist/metrics.h"
#include "../dist/shell.h"
#include "cluster.h"
#include "meshtrain/util.h"

using meshtrain::str_cat;
using meshtrain::testing::contains;
using meshtrain::testing::expect_same_losses;
using meshtrain::testing::Hosts;
using meshtrain::testing::kBin;
using meshtrain::testing::kTiny;
using meshtrain::testing::mpirun_command;
using meshtrain::testing::sh;
using meshtrain::testing::Shell;
using meshtrain::testing::TempDir;

namespace {

// OpenMPI across hosts (issue 30 item 3a): mpirun on host 0 starts host 1's
// ranks through its daemon, which tests/cluster/mpi_agent.sh starts inside
// host 1 as ssh would on a real cluster. The ranks take their places from
// OMPI_COMM_WORLD_*; under mpirun the trainer picks the MPI backend by itself
// (no store, no MASTER_ADDR), and a store backend asked for by name needs
// MASTER_ADDR passed with -x. Both train like one process, and nothing is
// left running on any host.
struct MpiLayout {
  const char* name;
  const char* backend_env;  // mpirun's -x for MESHTRAIN_BACKEND, or ""
  const char* master_port;  // where rank 0 puts the store, for a backend that meets through one; or ""
  const char* backend;      // the one the trainer says it uses
};

void PrintTo(const MpiLayout& l, std::ostream* os) { *os << l.name; }

class UnderMpirun : public ::testing::TestWithParam<MpiLayout> {};

TEST_P(UnderMpirun, TrainsLikeOneProcessAcrossHosts) {
  const MpiLayout& l = GetParam();
  Hosts hosts(2);
  if (!hosts.ok()) GTEST_SKIP() << "cannot make network namespaces here: " << hosts.why();
  TempDir t;
  const std::string common = kTiny + "--steps 8 --log-every 100 ";
  std::string env = l.backend_env;
  if (*l.master_port) env += str_cat(" -x MASTER_ADDR=", hosts.address(0), " -x MASTER_PORT=", l.master_port);
  Shell r = sh(mpirun_command(hosts, t, 2, 2,
                              str_cat(env, " ", kBin, "/meshtrain", common, "--dp 2 --pp 2 --metrics-out ",
                                      t.file("m.json"))));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "Data for node: " + hosts.address(1) + "\tNum slots: 2\tMax slots: 0\tNum procs: 2"))
      << r.output;
  EXPECT_TRUE(contains(r.output, str_cat("communication backend ", l.backend, " (world of 4"))) << r.output;
  Shell one = sh(kBin + "/meshtrain" + common + "--metrics-out " + t.file("one.json"));
  ASSERT_EQ(one.exit_code, 0) << one.output;
  expect_same_losses(meshtrain::json::parse_file(t.file("m.json")), meshtrain::json::parse_file(t.file("one.json")),
                     l.name);
  EXPECT_EQ(hosts.processes(0), "") << r.output;
  EXPECT_EQ(hosts.processes(1), "") << r.output;
}

}  // namespace

INSTANTIATE_TEST_SUITE_P(Cluster, UnderMpirun,
                         ::testing::Values(MpiLayout{"mpi_by_itself", "", "", "mpi"},
                                           MpiLayout{"gloo_through_the_store", "-x MESHTRAIN_BACKEND=gloo", "29612",
                                                     "gloo"}),
                         [](const ::testing::TestParamInfo<MpiLayout>& info) { return std::string(info.param.name); });
