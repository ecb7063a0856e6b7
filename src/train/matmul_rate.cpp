#include "train/matmul_rate.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <fstream>

#include "util/strings.h"

namespace meshtrain {
namespace train {

namespace {

// Two n x n inputs of `dtype` and the output, multiplied once (the warm-up:
// the thread pool, packing buffers), ready to time.
struct Product {
  at::Tensor a, b, c;
  Product(c10::ScalarType dtype, int64_t n) {
    const auto options = at::TensorOptions().dtype(dtype);
    a = at::randn({n, n}, options), b = at::randn({n, n}, options), c = at::empty({n, n}, options);
    seconds();
  }
  double seconds() {
    const auto start = std::chrono::steady_clock::now();
    at::mm_out(c, a, b);
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
};

}  // namespace

int64_t matmul_size_for(c10::ScalarType dtype, int64_t max_n) {
  at::NoGradGuard no_grad;
  const int64_t n = std::min<int64_t>(512, max_n);
  return Product(dtype, n).seconds() >= 0.05 ? n : max_n;
}

MatmulRate measure_matmul_rate(c10::ScalarType dtype, int repeats) {
  at::NoGradGuard no_grad;
  MatmulRate r;
  r.n = matmul_size_for(dtype);
  r.repeats = repeats;
  Product product(dtype, r.n);
  double best = 1e30;
  for (int i = 0; i < repeats; ++i) best = std::min(best, product.seconds());
  r.flops = 2.0 * static_cast<double>(r.n) * r.n * r.n / best;
  return r;
}

std::pair<double, int> time_matmuls(c10::ScalarType dtype, int64_t n, int min_count, double min_seconds,
                                    const std::function<void()>& start) {
  at::NoGradGuard no_grad;
  Product product(dtype, n);
  start();
  double total = 0;
  int count = 0;
  while (count < min_count || total < min_seconds) total += product.seconds(), ++count;
  return {total, count};
}

std::string cpu_model_name() {
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line;
  while (std::getline(cpuinfo, line)) {
    if (line.rfind("model name", 0) == 0) return trim(line.substr(line.find(':') + 1));
  }
  return "";
}

}  // namespace train
}  // namespace meshtrain
