#include "app/commands/measure_flops.h"

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>

namespace meshtrain {
namespace train {

int rank_threads() {
  const char* omp = std::getenv("OMP_NUM_THREADS");
  const int n = omp ? std::atoi(omp) : 0;
  return n > 0 ? n : at::get_num_threads();
}

double measure_matmul_flops(int threads, int n, int repeats) {
  const int before = at::get_num_threads();
  at::set_num_threads(threads);
  torch::NoGradGuard no_grad;
  const torch::Tensor a = torch::randn({n, n}), b = torch::randn({n, n});
  torch::Tensor c = torch::mm(a, b);  // warm-up: thread pool, caches
  double best = 1e30;
  for (int i = 0; i < repeats; ++i) {
    const auto start = std::chrono::steady_clock::now();
    torch::mm_out(c, a, b);
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  at::set_num_threads(before);
  return 2.0 * n * n * static_cast<double>(n) / best;
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
    const double flops = measure_matmul_flops(threads);
    char value[32];
    std::snprintf(value, sizeof value, "%.6g", flops / 1e12);
    out.push_back("--device-tflops");
    out.push_back(value);
    note = std::string("measured: a 1024 x 1024 float32 matmul at ") + value + " TFLOP/s with " +
           std::to_string(threads) + " threads (OMP_NUM_THREADS, as meshrun sets a rank's)";
    if (split) ++i;
  }
  return out;
}

}  // namespace train
}  // namespace meshtrain
