// Reduction kernels: one block loop per (dtype, op), inlined into functions
// cloned for AVX-512, AVX2 and the baseline (target_clones), so the compiler
// vectorizes each for the machine it runs on. A block of accumulators lives on
// the stack (L1); inputs stream through it in rank order.

#include "reduce.h"

#include <immintrin.h>

#include <cstring>

#include "meshtrain/util.h"

namespace meshtrain {
namespace comm {

namespace {

constexpr int64_t kBlock = 256;

// Loading and storing an element as its accumulator type.
template <typename T>
struct Same {
  using Acc = T;
  static inline void load_block(const T* src, Acc* dst, int64_t m) { std::memcpy(dst, src, m * sizeof(T)); }
  static inline void store_block(const Acc* src, T* dst, int64_t m) { std::memcpy(dst, src, m * sizeof(T)); }
};

struct BFloat16Bits {  // bfloat16 as uint16 bits, accumulated in float
  using Acc = float;
  static inline float load(uint16_t x) {
    const uint32_t u = static_cast<uint32_t>(x) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  static inline uint16_t store(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;  // round to nearest even
    return f != f ? static_cast<uint16_t>(0x7fc0) : static_cast<uint16_t>(rounded);
  }
  static inline void load_block(const uint16_t* src, float* dst, int64_t m) {
    for (int64_t i = 0; i < m; ++i) dst[i] = load(src[i]);
  }
  static inline void store_block(const float* src, uint16_t* dst, int64_t m) {
    for (int64_t i = 0; i < m; ++i) dst[i] = store(src[i]);
  }
};

struct HalfBits {  // float16 as uint16 bits, accumulated in float (portable conversions)
  using Acc = float;
  static inline void load_block(const uint16_t* src, float* dst, int64_t m) {
    for (int64_t i = 0; i < m; ++i) {
      _Float16 h;
      std::memcpy(&h, &src[i], 2);
      dst[i] = static_cast<float>(h);
    }
  }
  static inline void store_block(const float* src, uint16_t* dst, int64_t m) {
    for (int64_t i = 0; i < m; ++i) {
      const _Float16 h = static_cast<_Float16>(src[i]);  // round to nearest even
      std::memcpy(&dst[i], &h, 2);
    }
  }
};

// The same with the F16C instructions, eight at a time (kBlock is a multiple of 8).
struct HalfF16c {
  using Acc = float;
  static inline __attribute__((target("avx2,f16c,fma"))) void load_block(const uint16_t* src, float* dst, int64_t m) {
    int64_t i = 0;
    for (; i + 8 <= m; i += 8) {
      _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
    }
    HalfBits::load_block(src + i, dst + i, m - i);
  }
  static inline __attribute__((target("avx2,f16c,fma"))) void store_block(const float* src, uint16_t* dst, int64_t m) {
    int64_t i = 0;
    for (; i + 8 <= m; i += 8) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                       _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
    }
    HalfBits::store_block(src + i, dst + i, m - i);
  }
};

// Integers add and multiply as unsigned: wrap-around is defined.
template <typename T>
struct Wrap {
  using U = std::make_unsigned_t<T>;
  static inline T add(T a, T b) { return static_cast<T>(static_cast<U>(a) + static_cast<U>(b)); }
  static inline T mul(T a, T b) { return static_cast<T>(static_cast<U>(a) * static_cast<U>(b)); }
};

template <typename A>
inline A op_add(A a, A b) {
  if constexpr (std::is_integral_v<A>) return Wrap<A>::add(a, b); else return a + b;
}
template <typename A>
inline A op_mul(A a, A b) {
  if constexpr (std::is_integral_v<A>) return Wrap<A>::mul(a, b); else return a * b;
}
template <typename A>
inline A op_max(A a, A b) { return (a != a || a > b) ? a : b; }  // NaN wins
template <typename A>
inline A op_min(A a, A b) { return (a != a || a < b) ? a : b; }

template <typename T, typename Cvt, ReduceOp kOp>
inline __attribute__((always_inline)) void reduce_loop(T* out, const T* const* in, int k, int64_t count) {
  using Acc = typename Cvt::Acc;
  Acc acc[kBlock];
  for (int64_t base = 0; base < count; base += kBlock) {
    const int64_t m = count - base < kBlock ? count - base : kBlock;
    Acc x_block[kBlock];
    Cvt::load_block(in[0] + base, acc, m);
    for (int j = 1; j < k; ++j) {
      Cvt::load_block(in[j] + base, x_block, m);
      for (int64_t i = 0; i < m; ++i) {
        const Acc x = x_block[i];
        if constexpr (kOp == ReduceOp::kSum || kOp == ReduceOp::kAvg) acc[i] = op_add(acc[i], x);
        if constexpr (kOp == ReduceOp::kProduct) acc[i] = op_mul(acc[i], x);
        if constexpr (kOp == ReduceOp::kMax) acc[i] = op_max(acc[i], x);
        if constexpr (kOp == ReduceOp::kMin) acc[i] = op_min(acc[i], x);
      }
    }
    if constexpr (kOp == ReduceOp::kAvg) {
      const Acc divisor = static_cast<Acc>(k);
      for (int64_t i = 0; i < m; ++i) acc[i] = acc[i] / divisor;
    }
    Cvt::store_block(acc, out + base, m);
  }
}

template <typename T, typename Cvt>
inline __attribute__((always_inline)) void reduce_any_op(void* out, const void* const* in, int k, int64_t count,
                                                         ReduceOp op) {
  T* o = static_cast<T*>(out);
  const T* const* i = reinterpret_cast<const T* const*>(in);
  switch (op) {
    case ReduceOp::kSum: reduce_loop<T, Cvt, ReduceOp::kSum>(o, i, k, count); break;
    case ReduceOp::kAvg: reduce_loop<T, Cvt, ReduceOp::kAvg>(o, i, k, count); break;
    case ReduceOp::kProduct: reduce_loop<T, Cvt, ReduceOp::kProduct>(o, i, k, count); break;
    case ReduceOp::kMax: reduce_loop<T, Cvt, ReduceOp::kMax>(o, i, k, count); break;
    case ReduceOp::kMin: reduce_loop<T, Cvt, ReduceOp::kMin>(o, i, k, count); break;
  }
}

#define MESHTRAIN_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))

MESHTRAIN_CLONES void reduce_f32(void* o, const void* const* in, int k, int64_t n, ReduceOp op) {
  reduce_any_op<float, Same<float>>(o, in, k, n, op);
}
MESHTRAIN_CLONES void reduce_f64(void* o, const void* const* in, int k, int64_t n, ReduceOp op) {
  reduce_any_op<double, Same<double>>(o, in, k, n, op);
}
MESHTRAIN_CLONES void reduce_bf16(void* o, const void* const* in, int k, int64_t n, ReduceOp op) {
  reduce_any_op<uint16_t, BFloat16Bits>(o, in, k, n, op);
}
void reduce_f16_portable(void* o, const void* const* in, int k, int64_t n, ReduceOp op) {
  reduce_any_op<uint16_t, HalfBits>(o, in, k, n, op);
}
__attribute__((target("avx2,f16c,fma"))) void reduce_f16_f16c(void* o, const void* const* in, int k, int64_t n,
                                                               ReduceOp op) {
  reduce_any_op<uint16_t, HalfF16c>(o, in, k, n, op);
}
void reduce_f16(void* o, const void* const* in, int k, int64_t n, ReduceOp op) {
  static const bool f16c = __builtin_cpu_supports("f16c") && __builtin_cpu_supports("avx2");
  if (f16c) reduce_f16_f16c(o, in, k, n, op); else reduce_f16_portable(o, in, k, n, op);
}
MESHTRAIN_CLONES void reduce_i32(void* o, const void* const* in, int k, int64_t n, ReduceOp op) {
  reduce_any_op<int32_t, Same<int32_t>>(o, in, k, n, op);
}
MESHTRAIN_CLONES void reduce_i64(void* o, const void* const* in, int k, int64_t n, ReduceOp op) {
  reduce_any_op<int64_t, Same<int64_t>>(o, in, k, n, op);
}
MESHTRAIN_CLONES void reduce_i8(void* o, const void* const* in, int k, int64_t n, ReduceOp op) {
  reduce_any_op<int8_t, Same<int8_t>>(o, in, k, n, op);
}
MESHTRAIN_CLONES void reduce_u8(void* o, const void* const* in, int k, int64_t n, ReduceOp op) {
  reduce_any_op<uint8_t, Same<uint8_t>>(o, in, k, n, op);
}

}  // namespace

void reduce_into(void* out, const void* const* in, int k, int64_t count, at::ScalarType dtype, ReduceOp op) {
  if (count <= 0 || k <= 0) return;
  switch (dtype) {
    case at::kFloat: return reduce_f32(out, in, k, count, op);
    case at::kDouble: return reduce_f64(out, in, k, count, op);
    case at::kBFloat16: return reduce_bf16(out, in, k, count, op);
    case at::kHalf: return reduce_f16(out, in, k, count, op);
    case at::kInt: return reduce_i32(out, in, k, count, op);
    case at::kLong: return reduce_i64(out, in, k, count, op);
    case at::kChar: return reduce_i8(out, in, k, count, op);
    case at::kByte: return reduce_u8(out, in, k, count, op);
    default:
      throw ConfigError(str_cat("reduce: dtype ", dtype, " is not supported"));
  }
}

}  // namespace comm
}  // namespace meshtrain
