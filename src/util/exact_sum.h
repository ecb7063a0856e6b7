#pragma once
// An exact sum of squares of floating-point numbers: the gradient norm that
// does not depend on how the elements are split over ranks (issue 33's
// deterministic mode clips with it).
//
// Note [Exact sum of squares]
// A float32 x is m * 2^e with an integer m < 2^24 (subnormals included), so
// x^2 = m^2 * 2^(2e) with m^2 < 2^48: an integer at a known bit position. The
// sum of any number of them is an integer multiple of 2^-298 (the smallest
// square), held here as 32-bit digits in int64 slots. Integer addition is
// associative, so the digits after any split of the elements over ranks, in
// any order, summed by an all-reduce of int64s in any order, are the same; one
// fixed conversion of the canonical digits to a double then gives one process's
// bits on every layout. Slots take 2^30 additions between carries (each adds
// less than 2^32), and a carry pass runs before that.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace meshtrain {

class ExactSquareSum {
 public:
  ExactSquareSum();
  // Adds the squares of every element (float32, bfloat16 or float16: each
  // widens to float32 exactly).
  void add_squares(const at::Tensor& values);
  // The digits as a 1-D int64 tensor, carried: what an all-reduce (sum) over
  // ranks adds; from_digits takes the sum back.
  at::Tensor digits();
  static ExactSquareSum from_digits(const at::Tensor& digits);
  // The sum, rounded to a double by one fixed procedure (inf when an element
  // was infinite, nan when one was nan).
  double value();

 private:
  void add_float(float x);
  void carry();

  std::vector<int64_t> slots_;  // slot i: digit of weight 2^(32 i - 298); the last holds the overflow
  int64_t since_carry_ = 0;
  int64_t infinities_ = 0, nans_ = 0;
};

}  // namespace meshtrain
