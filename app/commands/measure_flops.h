#pragma once
// `meshtrain plan --device-tflops measure`: the planner is pure arithmetic
// (meshtrain::plan); the rate it computes at is measured here, with libtorch,
// and handed to it as a number.

#include <string>
#include <vector>

namespace meshtrain {
namespace train {

// Achieved FLOP/s of a float32 n x n matmul (2 n^3 FLOPs) on this machine
// with `threads` intra-op threads (the rank's: OMP_NUM_THREADS, as meshrun
// exports it, else libtorch's default): the best of `repeats` timed runs
// after one warm-up.
double measure_matmul_flops(int threads, int n = 1024, int repeats = 5);

// Threads a rank would use here: OMP_NUM_THREADS when set, else libtorch's count.
int rank_threads();

// `meshtrain plan` arguments with "--device-tflops measure" (or
// "--device-tflops=measure") replaced by the measured TFLOP/s; `note` says
// what was measured ("" when nothing was). Other arguments are untouched.
std::vector<std::string> resolve_measured_tflops(const std::vector<std::string>& args, std::string& note);

}  // namespace train
}  // namespace meshtrain
