#pragma once
// What --eval-every evaluates (internal to the trainer): --val-data's first
// --val-batches global batches, in file order; without it (text files and the
// built-in tasks) one global batch of the training data's samples from index
// 2^40 on, far from any training index. Token shards without --val-data are
// refused in resolve: their windows wrap ((2^40 + s) mod W is a training window).

#include <memory>

#include "app/trainer/config.h"
#include "meshtrain/train.h"

namespace meshtrain {
namespace train {

struct HeldOut {
  std::unique_ptr<Dataset> data;
  int64_t first = 0;    // the first sample
  int64_t batches = 1;  // global batches, from `first` on
};

HeldOut make_held_out(const TrainConfig& resolved);

}  // namespace train
}  // namespace meshtrain
