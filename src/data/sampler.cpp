#include "meshtrain/data.h"

#include <ATen/ATen.h>

#include "meshtrain/comm.h"
#include "meshtrain/util.h"

namespace meshtrain {
namespace data {

namespace {

// splitmix64's finalizer: a bijective 64-bit mix with full avalanche.
uint64_t mix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// Bits needed to write n (0 for 0).
int bit_width(uint64_t n) {
  int bits = 0;
  for (; n > 0; n >>= 1) ++bits;
  return bits;
}

}  // namespace

Permutation::Permutation(int64_t size, uint64_t seed, int64_t epoch) : size_(size) {
  MESHTRAIN_CHECK(size >= 1, "Permutation: size ", size, " must be at least 1");
  MESHTRAIN_CHECK(epoch >= 0, "Permutation: epoch ", epoch, " must be >= 0");
  // Two halves of h bits each cover [0, size): 4^h >= size, h >= 1.
  half_bits_ = std::max(1, (bit_width(static_cast<uint64_t>(size - 1)) + 1) / 2);
  half_mask_ = (uint64_t{1} << half_bits_) - 1;
  // Keys from (seed, epoch) through two mixes, so that neighbouring seeds or
  // epochs give unrelated orders.
  const uint64_t key = mix64(mix64(seed) ^ mix64(static_cast<uint64_t>(epoch) + 0x632BE59BD9B4E019ull));
  for (int r = 0; r < kRounds; ++r) round_keys_[r] = mix64(key + static_cast<uint64_t>(r) * 0xD1B54A32D192ED03ull);
}

uint64_t Permutation::encrypt(uint64_t x) const {
  uint64_t left = x >> half_bits_, right = x & half_mask_;
  for (int r = 0; r < kRounds; ++r) {
    // (L, R) -> (R, L xor F(R)): invertible whatever F is.
    const uint64_t next = left ^ (mix64(right ^ round_keys_[r]) & half_mask_);
    left = right;
    right = next;
  }
  return (left << half_bits_) | right;
}

int64_t Permutation::operator()(int64_t i) const {
  MESHTRAIN_CHECK(i >= 0 && i < size_, "Permutation: index ", i, " is outside [0, ", size_, ")");
  uint64_t y = encrypt(static_cast<uint64_t>(i));
  while (y >= static_cast<uint64_t>(size_)) y = encrypt(y);  // cycle walking
  return static_cast<int64_t>(y);
}

int64_t sample_at(int64_t position, int64_t size, uint64_t seed, bool shuffle) {
  MESHTRAIN_CHECK(position >= 0 && size >= 1, "sample_at: position ", position, " and size ", size,
                  " must be >= 0 and >= 1");
  const int64_t within = position % size;
  return shuffle ? Permutation(size, seed, position / size)(within) : within;
}

DistributedSampler::DistributedSampler(int64_t size, DistributedSamplerOptions options)
    : size_(size), options_(options) {
  const auto& o = options_;
  MESHTRAIN_CHECK(size >= 1, "DistributedSampler: the dataset has ", size, " samples; it needs at least one");
  MESHTRAIN_CHECK(o.dp_size() >= 1 && o.dp_rank() >= 0 && o.dp_rank() < o.dp_size(), "DistributedSampler: dp_rank ",
                  o.dp_rank(), " is outside [0, dp_size ", o.dp_size(), ")");
  MESHTRAIN_CHECK(o.global_batch() >= 1 && o.global_batch() % o.dp_size() == 0, "DistributedSampler: global_batch ",
                  o.global_batch(), " must be a positive multiple of dp_size ", o.dp_size(),
                  " (each data-parallel rank takes an equal slice)");
}

std::vector<int64_t> DistributedSampler::positions(int64_t first, int64_t count) const {
  std::vector<int64_t> out;
  out.reserve(static_cast<size_t>(count));
  for (int64_t p = first; p < first + count; ++p) out.push_back(sample_at(p, size_, options_.seed(), options_.shuffle()));
  return out;
}

std::vector<int64_t> DistributedSampler::global_batch(int64_t step) const {
  MESHTRAIN_CHECK(step >= 0, "DistributedSampler: step ", step, " must be >= 0");
  return positions(step * options_.global_batch(), options_.global_batch());
}

std::vector<int64_t> DistributedSampler::local_batch(int64_t step) const {
  MESHTRAIN_CHECK(step >= 0, "DistributedSampler: step ", step, " must be >= 0");
  const int64_t local = options_.global_batch() / options_.dp_size();
  return positions(step * options_.global_batch() + options_.dp_rank() * local, local);
}

int64_t DistributedSampler::epoch_of(int64_t step) const { return step * options_.global_batch() / size_; }

double global_mean_loss(double local_mean, comm::Communicator& dp) {
  at::Tensor sum = at::tensor({local_mean}, at::kDouble);
  dp.all_reduce(sum);
  return sum.item<double>() / dp.size();
}

}  // namespace data
}  // namespace meshtrain
