// Note [Exact sum of squares] in util/exact_sum.h.
#include "util/exact_sum.h"

#include <ATen/ATen.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "meshtrain/util.h"

namespace meshtrain {

namespace {

constexpr int kBase = 298;  // x^2 >= 2^-298 for the smallest subnormal x = 2^-149
// The largest square is below 2^256, bit 554 from the base; 3 slots of carry headroom.
constexpr int kSlots = (554 + 31) / 32 + 3;
constexpr int64_t kCarryEvery = int64_t{1} << 30;
constexpr int kCounters = 2;  // infinities and nans travel with the digits

}  // namespace

ExactSquareSum::ExactSquareSum() : slots_(kSlots, 0) {}

void ExactSquareSum::add_float(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  const uint32_t exponent = (bits >> 23) & 0xff, fraction = bits & 0x7fffff;
  if (exponent == 0xff) {
    (fraction ? nans_ : infinities_) += 1;
    return;
  }
  // x = m * 2^e exactly; m^2 * 2^(2e) sits at bit 2e + kBase.
  const uint64_t m = exponent == 0 ? fraction : (fraction | 0x800000u);
  const int e = exponent == 0 ? -149 : static_cast<int>(exponent) - 150;
  if (m == 0) return;
  const int position = 2 * e + kBase;
  const unsigned __int128 shifted = static_cast<unsigned __int128>(m * m) << (position & 31);
  int64_t* slot = &slots_[position >> 5];
  slot[0] += static_cast<int64_t>(static_cast<uint32_t>(shifted));
  slot[1] += static_cast<int64_t>(static_cast<uint32_t>(shifted >> 32));
  slot[2] += static_cast<int64_t>(static_cast<uint64_t>(shifted >> 64));
  if (++since_carry_ == kCarryEvery) carry();
}

void ExactSquareSum::add_squares(const at::Tensor& values) {
  if (!values.defined() || values.numel() == 0) return;
  MESHTRAIN_CHECK(values.scalar_type() == at::kFloat || values.scalar_type() == at::kBFloat16 ||
                      values.scalar_type() == at::kHalf,
                  "ExactSquareSum: ", values.scalar_type(), " elements; the exact sum takes float32, bfloat16 or "
                  "float16 (their squares are exact integers at a known scale)");
  const at::Tensor f = values.detach().to(at::kFloat).contiguous();
  const float* data = f.data_ptr<float>();
  for (int64_t i = 0, n = f.numel(); i < n; ++i) add_float(data[i]);
}

void ExactSquareSum::carry() {
  for (int i = 0; i + 1 < kSlots; ++i) {
    slots_[i + 1] += slots_[i] >> 32;
    slots_[i] &= 0xffffffff;
  }
  since_carry_ = 0;
}

at::Tensor ExactSquareSum::digits() {
  carry();
  at::Tensor out = at::empty({kSlots + kCounters}, at::kLong);
  int64_t* d = out.data_ptr<int64_t>();
  std::memcpy(d, slots_.data(), kSlots * sizeof(int64_t));
  d[kSlots] = infinities_;
  d[kSlots + 1] = nans_;
  return out;
}

ExactSquareSum ExactSquareSum::from_digits(const at::Tensor& digits) {
  MESHTRAIN_CHECK(digits.scalar_type() == at::kLong && digits.numel() == kSlots + kCounters,
                  "ExactSquareSum::from_digits: expected ", kSlots + kCounters, " int64 digits, got ", digits.numel(),
                  " of ", digits.scalar_type());
  ExactSquareSum s;
  const at::Tensor c = digits.contiguous();
  const int64_t* d = c.data_ptr<int64_t>();
  std::memcpy(s.slots_.data(), d, kSlots * sizeof(int64_t));
  s.infinities_ = d[kSlots];
  s.nans_ = d[kSlots + 1];
  return s;
}

double ExactSquareSum::value() {
  if (nans_ > 0) return std::numeric_limits<double>::quiet_NaN();
  if (infinities_ > 0) return std::numeric_limits<double>::infinity();
  carry();  // canonical digits: one sum has one representation
  double sum = 0;
  for (int i = kSlots - 1; i >= 0; --i) sum += std::ldexp(static_cast<double>(slots_[i]), 32 * i - kBase);
  return sum;
}

}  // namespace meshtrain
