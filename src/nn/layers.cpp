#include "meshtrain/nn.h"

#include <ATen/ATen.h>

#include <cmath>

#include "meshtrain/util.h"

namespace meshtrain {
namespace nn {

RMSNormImpl::RMSNormImpl(int64_t dim, double epsilon) : eps(epsilon) {
  weight = register_parameter("weight", at::ones({dim}));
}

at::Tensor RMSNormImpl::forward(const at::Tensor& x) {
  const at::Tensor x32 = x.to(at::kFloat);
  const at::Tensor normed = x32 * at::rsqrt(x32.pow(2).mean(-1, /*keepdim=*/true) + eps);
  return weight * normed.to(x.scalar_type());
}

Rotary::Rotary(int64_t head_dim, int64_t max_positions, double theta) {
  MESHTRAIN_CHECK(head_dim % 2 == 0, "rotary embeddings need an even head dimension; got ", head_dim,
                  " (--hidden / --heads)");
  const int64_t half = head_dim / 2;
  at::Tensor angles = at::empty({max_positions, head_dim}, at::kDouble);
  auto a = angles.accessor<double, 2>();
  for (int64_t pos = 0; pos < max_positions; ++pos) {
    for (int64_t i = 0; i < half; ++i) {
      const double angle = static_cast<double>(pos) * std::pow(theta, -2.0 * static_cast<double>(i) / head_dim);
      a[pos][i] = a[pos][i + half] = angle;
    }
  }
  cos_ = angles.cos().to(at::kFloat);
  sin_ = angles.sin().to(at::kFloat);
}

namespace {

// x rotated by the table rows of its positions (cos, sin: [T, d] float32).
at::Tensor rotate(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t half = x.size(3) / 2;
  const at::Tensor rotated = at::cat({-x.narrow(3, half, half), x.narrow(3, 0, half)}, 3);  // rotate_half
  return x * cos.to(x.scalar_type()) + rotated * sin.to(x.scalar_type());
}

}  // namespace

at::Tensor Rotary::apply(const at::Tensor& x, int64_t start) const {
  const int64_t T = x.size(2);
  MESHTRAIN_CHECK(start + T <= cos_.size(0), "position ", start + T - 1, " is beyond the model's ", cos_.size(0),
                  " positions (--seq-len)");
  return rotate(x, cos_.narrow(0, start, T), sin_.narrow(0, start, T));
}

at::Tensor Rotary::apply(const at::Tensor& x, const at::Tensor& positions) const {
  MESHTRAIN_CHECK(positions.dim() == 1 && positions.size(0) == x.size(2), "Rotary::apply: ", positions.numel(),
                  " positions for ", x.size(2), " tokens");
  MESHTRAIN_CHECK(positions.max().item<int64_t>() < cos_.size(0), "position ", positions.max().item<int64_t>(),
                  " is beyond the model's ", cos_.size(0), " positions (--seq-len)");
  return rotate(x, cos_.index_select(0, positions), sin_.index_select(0, positions));
}

std::pair<at::Tensor, at::Tensor> KVCache::append(const at::Tensor& new_k, const at::Tensor& new_v) {
  k = k.defined() ? at::cat({k, new_k}, 2) : new_k;
  v = v.defined() ? at::cat({v, new_v}, 2) : new_v;
  return {k, v};
}

}  // namespace nn
}  // namespace meshtrain
