#include "app/commands/measure_flops.h"

#include <ATen/Parallel.h>

#include <cstdio>
#include <cstdlib>

#include "train/matmul_rate.h"

namespace meshtrain {
namespace train {

int rank_threads() {
  const char* omp = std::getenv("OMP_NUM_THREADS");
  const int n = omp ? std::atoi(omp) : 0;
  return n > 0 ? n : at::get_num_threads();
}

std::vector<std::string> resolve_measured_tflops(const std::vector<std::string>& args, std::string& note) {
  std::vector<std::string> out;
  for (size_t i = 0; i < args.size(); ++i) {
    const bool split = args[i] == "--device-tflops" && i + 1 < args.size() && args[i + 1] == "measure";
    const bool joined = args[i] == "--device-tflops=measure";
    if (!split && !joined) {
      out.push_back(args[i]);
      continue;
    }
    const int threads = rank_threads();
    const int before = at::get_num_threads();
    at::set_num_threads(threads);
    const MatmulRate rate = measure_matmul_rate(at::kFloat);
    at::set_num_threads(before);
    char value[32];
    std::snprintf(value, sizeof value, "%.6g", rate.flops / 1e12);
    out.push_back("--device-tflops");
    out.push_back(value);
    note = "measured: a " + std::to_string(rate.n) + "^3 float32 matmul at " + value + " TFLOP/s with " +
           std::to_string(threads) + " threads (OMP_NUM_THREADS, as meshrun sets a rank's)";
    if (split) ++i;
  }
  return out;
}

}  // namespace train
}  // namespace meshtrain
