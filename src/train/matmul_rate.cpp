#include "train/matmul_rate.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <fstream>

#include "util/strings.h"

namespace meshtrain {
namespace train {

namespace {

double seconds_of_one(const at::Tensor& a, const at::Tensor& b, at::Tensor& c) {
  const auto start = std::chrono::steady_clock::now();
  at::mm_out(c, a, b);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

MatmulRate measure_matmul_rate(c10::ScalarType dtype, int64_t max_n, double budget_seconds) {
  at::NoGradGuard no_grad;
  const auto options = at::TensorOptions().dtype(dtype);
  MatmulRate r;
  at::Tensor a, b, c;
  double best = 0;
  for (int64_t n = 256;; n *= 2) {
    a = at::randn({n, n}, options), b = at::randn({n, n}, options), c = at::empty({n, n}, options);
    seconds_of_one(a, b, c);  // warm-up: thread pool, caches, packing buffers
    best = seconds_of_one(a, b, c);
    r.n = n;
    if (best >= 0.02 || 2 * n > max_n) break;
  }
  r.repeats = 1;
  double spent = best;
  while (r.repeats < 3 || spent + best <= budget_seconds) {
    const double t = seconds_of_one(a, b, c);
    spent += t;
    best = std::min(best, t);
    ++r.repeats;
  }
  r.flops = 2.0 * static_cast<double>(r.n) * r.n * r.n / best;
  return r;
}

double seconds_of_matmuls(c10::ScalarType dtype, int64_t n, int count, const std::function<void()>& start) {
  at::NoGradGuard no_grad;
  const auto options = at::TensorOptions().dtype(dtype);
  const at::Tensor a = at::randn({n, n}, options), b = at::randn({n, n}, options);
  at::Tensor c = at::empty({n, n}, options);
  seconds_of_one(a, b, c);
  start();
  double total = 0;
  for (int i = 0; i < count; ++i) total += seconds_of_one(a, b, c);
  return total;
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
