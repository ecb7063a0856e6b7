#pragma once
// Elementwise reductions over raw buffers, for every dtype the communicators
// move: the arithmetic of every backend's reduce steps, without a tensor or a
// dispatcher call in the way (a 4 KiB shared-memory all-reduce costs a few
// microseconds in all; ATen's per-call overhead would be most of it).
//
//   out[i] = in[0][i] op in[1][i] op ... op in[k-1][i]
//
// combined in input order, so every rank computing the same reduction gets
// bit-identical results. float16 and bfloat16 accumulate in float32 and round
// once; kAvg divides the sum by k before that rounding. Integer sums and
// products wrap (two's complement). kMax/kMin propagate NaN, as torch does.
// `out` may alias an input (element i is read before it is written). The
// loops are compiled for AVX-512, AVX2 and baseline x86-64 and picked at run time.

#include <c10/core/ScalarType.h>

#include <cstdint>

#include "meshtrain/comm.h"

namespace meshtrain {
namespace comm {

void reduce_into(void* out, const void* const* in, int k, int64_t count, at::ScalarType dtype, ReduceOp op);

// Two inputs, the common case: out = a op b.
inline void reduce_into(void* out, const void* a, const void* b, int64_t count, at::ScalarType dtype,
                        ReduceOp op) {
  const void* in[2] = {a, b};
  reduce_into(out, in, 2, count, dtype, op);
}

// The op a partial reduction applies: kAvg sums, and whoever holds the whole sum divides it once.
inline ReduceOp summing(ReduceOp op) { return op == ReduceOp::kAvg ? ReduceOp::kSum : op; }

}  // namespace comm
}  // namespace meshtrain
