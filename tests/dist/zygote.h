#pragma once
// Note [Rank zygote]
//
// A rank process started by exec pays libtorch's static initialization
// (~0.4 s of CPU, the registration of every operator) before it runs a line
// of the test; the suite starts about a thousand ranks, minutes on two cores.
// So the harness starts one zygote per test binary, by exec, the first time it
// needs ranks: the zygote finishes loading libtorch, then waits on a pipe
// without running any libtorch op or starting any thread, and forks each rank
// from that clean state. A fork before any libtorch op is safe (libgomp's
// thread pool, the reason the harness never forks itself, does not exist yet).
//
// The rank is forked twice, so that it is reparented to the harness (a child
// subreaper): the harness waits for it and kills it exactly as it does a rank
// it started itself. The rank then continues the binary's start-up (static
// initialization, main, gtest with GTEST_FILTER naming the test) with the
// environment the harness asked for, and runs the test body as any rank does.
//
// MESHTRAIN_HARNESS_NO_ZYGOTE=1 starts every rank by exec instead.

#include <sys/types.h>

#include <string>
#include <vector>

namespace meshtrain {
namespace testing {

// This process's environment with `extra` ("NAME=value") replacing the
// variables it names, less gtest's sharding (a rank runs exactly the test its
// filter names; ctest runs dist_tests in shards).
std::vector<std::string> environment_with(const std::vector<std::string>& extra);

// Starts a rank process with exactly `environment`, gtest filtered to `test`,
// stdout and stderr to `log_path`; returns its pid, a child of this process.
// Forked by the zygote, or, when none is available, started by exec.
pid_t spawn_rank(const std::vector<std::string>& environment, const std::string& test, const std::string& log_path);

// Starts argv[0] (a path) with `argv` and exactly `environment`, stdout and
// stderr to `log_path`, by fork and exec; it dies with this process. (mpirun,
// which starts the ranks of an MPI run itself.)
pid_t spawn_command(const std::vector<std::string>& argv, const std::vector<std::string>& environment,
                    const std::string& log_path);

}  // namespace testing
}  // namespace meshtrain
