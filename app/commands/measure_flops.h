#pragma once
// `meshtrain plan --device-tflops measure`: the planner is pure arithmetic
// (meshtrain::plan); the rate it computes at is measured here, with libtorch,
// and handed to it as a number.

#include <string>
#include <vector>

namespace meshtrain {
namespace train {

// Threads a rank would use here: OMP_NUM_THREADS when set, else libtorch's count.
int rank_threads();

// `meshtrain plan` arguments with "--device-tflops measure" (or
// "--device-tflops=measure") replaced by the measured TFLOP/s; `note` says
// what was measured ("" when nothing was). Other arguments are untouched.
std::vector<std::string> resolve_measured_tflops(const std::vector<std::string>& args, std::string& note);

}  // namespace train
}  // namespace meshtrain
