#pragma once
// The speed of this process's matrix products: the denominator of model FLOPs
// utilisation (Note [An honest MFU]) and what decides whether bf16 pays.

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <functional>
#include <string>

namespace meshtrain {
namespace train {

struct MatmulRate {
  double flops = 0;  // FLOP/s: 2 n^3 over the best time
  int64_t n = 0;     // the product measured, n x n by n x n
  int repeats = 0;   // timed runs, the best one counted
};

// Measures now, with this process's intra-op threads, a square product of
// `dtype`: n doubles from 256 until one product takes 20 ms or n reaches
// max_n (large enough for the kernels to reach their speed, small enough to
// stay quick where the dtype is slow), then the best of the runs that fit
// `budget_seconds` (at least 3).
MatmulRate measure_matmul_rate(c10::ScalarType dtype, int64_t max_n = 2048, double budget_seconds = 0.25);

// Seconds that `count` n x n products of `dtype` take one after another,
// timed from after `start()` returns (inputs made and a warm-up run before it:
// ranks measuring together start at a barrier there).
double seconds_of_matmuls(c10::ScalarType dtype, int64_t n, int count, const std::function<void()>& start);

// The CPU's model name (/proc/cpuinfo), "" where unknown.
std::string cpu_model_name();

}  // namespace train
}  // namespace meshtrain
