#include "meshtrain/util.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <limits>


namespace meshtrain {

namespace {

uint64_t splitmix64(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

thread_local bool skip_random_init = false;

}  // namespace

SkipRandomInit::SkipRandomInit() : previous_(skip_random_init) { skip_random_init = true; }
SkipRandomInit::~SkipRandomInit() { skip_random_init = previous_; }

uint64_t hash_key(uint64_t seed, const std::string& name) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a
  for (unsigned char c : name) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return splitmix64(h ^ splitmix64(seed));
}

double hash_uniform(uint64_t key, uint64_t counter) {
  return static_cast<double>(splitmix64(key ^ splitmix64(counter)) >> 11) * (1.0 / 9007199254740992.0);
}

at::Tensor init_slice(uint64_t seed, const std::string& name, const InitSpec& spec,
                      const std::vector<int64_t>& full_shape, int64_t dim, int64_t start,
                      int64_t length) {
  const int64_t ndim = static_cast<int64_t>(full_shape.size());
  MESHTRAIN_CHECK(ndim == 0 || (dim >= 0 && dim < ndim), "init_slice(", name, "): dim ", dim,
                  " out of range for ", ndim, " dims");
  MESHTRAIN_CHECK(ndim == 0 || (start >= 0 && length >= 0 && start + length <= full_shape[dim]),
                  "init_slice(", name, "): slice [", start, ", ", start + length, ") out of range");
  std::vector<int64_t> shape = full_shape;
  int64_t outer = 1, inner = 1, full_dim = 1;
  if (ndim > 0) {
    shape[dim] = length;
    for (int64_t d = 0; d < dim; ++d) outer *= full_shape[d];
    for (int64_t d = dim + 1; d < ndim; ++d) inner *= full_shape[d];
    full_dim = full_shape[dim];
  } else {
    length = 1;
  }
  at::Tensor out = at::empty(shape, at::kFloat);
  if (spec.kind == InitSpec::Kind::kConstant) return out.fill_(spec.a);
  if (skip_random_init) return out.fill_(std::numeric_limits<float>::quiet_NaN());
  float* data = out.data_ptr<float>();
  const uint64_t key = hash_key(seed, name);
  const int64_t per_outer = length * inner;
  at::parallel_for(0, outer * per_outer, 4096, [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k) {
      const int64_t o = k / per_outer, rest = k % per_outer;
      const int64_t j = rest / inner, i = rest % inner;
      const uint64_t full_index = static_cast<uint64_t>(o * full_dim * inner + (start + j) * inner + i);
      const double u1 = hash_uniform(key, 2 * full_index);
      double v;
      if (spec.kind == InitSpec::Kind::kUniform) {
        v = spec.a + (spec.b - spec.a) * u1;
      } else {  // Box-Muller
        const double u2 = hash_uniform(key, 2 * full_index + 1);
        v = spec.a + spec.b * std::sqrt(-2.0 * std::log(1.0 - u1)) * std::cos(2.0 * M_PI * u2);
      }
      data[k] = static_cast<float>(v);
    }
  });
  return out;
}

at::Tensor init_full(uint64_t seed, const std::string& name, const InitSpec& spec,
                     const std::vector<int64_t>& full_shape) {
  return init_slice(seed, name, spec, full_shape, 0, 0, full_shape.empty() ? 1 : full_shape[0]);
}

}  // namespace meshtrain
