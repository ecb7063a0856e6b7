#pragma once
// Which samples a step trains on, the same on every layout and every rank.
//
// The order is global, then split (DESIGN principle 5): the samples of the
// whole run form one sequence of positions 0, 1, 2, ...; step k's global batch
// is positions [kG, (k+1)G), and data-parallel rank r of D takes the
// contiguous slice [kG + rG/D, kG + (r+1)G/D). Position p lies in epoch
// e = p / N of a dataset of N samples and reads sample
//   shuffle:  Permutation(N, seed, e)(p mod N)      (a new order each epoch)
//   in order: p mod N
// So the position in the data is the step number: resuming from a checkpoint
// of step k continues exactly, on any layout, and nothing but (N, seed) is
// needed to know every batch of the run. The built-in trainer's token shards
// are read this way with seed --seed (and in order with --no-shuffle).
//
// Example, a user's loop over a dataset of N samples on the mesh's dp axis:
//
//   data::DistributedSampler sampler(N, data::DistributedSamplerOptions()
//       .global_batch(32).dp_size(dp->size()).dp_rank(dp->rank()).seed(1234));
//   for (int64_t step = first_step; step < steps; ++step) {
//     std::vector<int64_t> mine = sampler.local_batch(step);   // 32 / dp indices
//     double loss = train_on(mine);                            // this rank's mean
//     double global = data::global_mean_loss(loss, *dp);       // the batch's mean
//   }

#include <torch/arg.h>

#include <array>
#include <cstdint>
#include <vector>

namespace meshtrain {
namespace comm {
class Communicator;
}
namespace data {

// A pseudo-random bijection of [0, size) keyed by (seed, epoch), in O(1)
// memory: a 6-round balanced Feistel network over 2h bits (4^h >= size, the
// next power of two of even width), with cycle walking — an output >= size
// is encrypted again until it falls inside, which stays a bijection because
// it follows the network's own cycles. At most 4x the domain, so about 4
// encryptions per index on average.
class Permutation {
 public:
  Permutation(int64_t size, uint64_t seed, int64_t epoch);
  int64_t size() const { return size_; }
  // The image of i, for i in [0, size()).
  int64_t operator()(int64_t i) const;

 private:
  static constexpr int kRounds = 6;
  uint64_t encrypt(uint64_t x) const;  // a bijection of [0, 4^half_bits_)

  int64_t size_;
  int half_bits_;
  uint64_t half_mask_;
  std::array<uint64_t, kRounds> round_keys_;
};

// The sample that run position `position` reads from a dataset of `size`
// samples (see the header comment).
int64_t sample_at(int64_t position, int64_t size, uint64_t seed, bool shuffle);

struct DistributedSamplerOptions {
  // Samples per step over all data-parallel ranks; dp_size must divide it.
  TORCH_ARG(int64_t, global_batch) = 1;
  TORCH_ARG(int, dp_size) = 1;
  TORCH_ARG(int, dp_rank) = 0;
  // A new order every epoch (Permutation(size, seed, epoch)); off: in order.
  TORCH_ARG(bool, shuffle) = true;
  TORCH_ARG(uint64_t, seed) = 0;
};

// The sample indices of each step: the global batch, and this dp rank's
// contiguous slice of it. A batch that crosses the end of an epoch takes the
// rest from the next epoch's order (no sample dropped, none padded).
class DistributedSampler {
 public:
  // ConfigError when size < 1, global_batch < 1, dp_size does not divide
  // global_batch or dp_rank is outside [0, dp_size).
  DistributedSampler(int64_t size, DistributedSamplerOptions options);
  // Step `step`'s global batch: global_batch indices in [0, size).
  std::vector<int64_t> global_batch(int64_t step) const;
  // This dp rank's slice of global_batch(step): global_batch / dp_size indices.
  std::vector<int64_t> local_batch(int64_t step) const;
  // The epoch step `step`'s first sample belongs to.
  int64_t epoch_of(int64_t step) const;
  int64_t size() const { return size_; }
  const DistributedSamplerOptions& options() const { return options_; }

 private:
  std::vector<int64_t> positions(int64_t first, int64_t count) const;

  int64_t size_;
  DistributedSamplerOptions options_;
};

// The mean loss over the global batch from each dp rank's mean over its
// (equal-sized) slice: the all-reduced sum of local means / dp size, on every
// rank of `dp`. A collective: every rank of `dp` calls it.
double global_mean_loss(double local_mean, comm::Communicator& dp);

}  // namespace data
}  // namespace meshtrain
