#pragma once
// The speed of this process's matrix products: the denominator of model FLOPs
// utilisation (Note [An honest MFU]) and what decides whether bf16 pays.

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <functional>
#include <string>
#include <utility>

namespace meshtrain {
namespace train {

struct MatmulRate {
  double flops = 0;  // FLOP/s: 2 n^3 over the best time
  int64_t n = 0;     // the product measured, n x n by n x n
  int repeats = 0;   // timed runs, the best one counted
};

// The size of square product of `dtype` worth timing here: max_n, unless
// one 512^3 product already takes 50 ms, under 5.4 GFLOP/s (a dtype this CPU has no instructions
// for: bf16 without AVX512_BF16 runs 30-40x slower), then 512. On these
// CPUs a 512^3 float32 product already reaches the kernels' speed.
int64_t matmul_size_for(c10::ScalarType dtype, int64_t max_n = 1024);

// Measures now, with this process's intra-op threads: the best of `repeats`
// products of matmul_size_for(dtype) after a warm-up.
MatmulRate measure_matmul_rate(c10::ScalarType dtype, int repeats = 3);

// n x n products of `dtype` one after another, at least `min_count` and
// until `min_seconds` have passed, timed from after `start()` returns (inputs
// made and a warm-up run before it: ranks measuring together start at a
// barrier there). Returns {seconds, products}.
std::pair<double, int> time_matmuls(c10::ScalarType dtype, int64_t n, int min_count, double min_seconds,
                                    const std::function<void()>& start);

// The CPU's model name (/proc/cpuinfo), "" where unknown.
std::string cpu_model_name();

}  // namespace train
}  // namespace meshtrain
