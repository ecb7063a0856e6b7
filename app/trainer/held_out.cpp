#include "held_out.h"

#include "engine.h"
#include "meshtrain/train.h"

namespace meshtrain {
namespace train {

HeldOut make_held_out(const TrainConfig& c) {
  HeldOut h;
  if (c.val_data.empty()) {
    h.data = make_dataset(c);
    h.first = int64_t{1} << 40;
    return h;
  }
  h.batches = c.val_batches;
  // The same windows on every layout and at every evaluation: file order, no shuffle.
  h.data = data_is_token_shards(c.val_data)
               ? make_token_shard_dataset(expand_data_paths(c.val_data, "--val-data"), c.model.seq_len,
                                          WindowOrder().shuffle(false).vocab(c.model.vocab))
               : make_text_dataset(c.val_data, c.seed, c.model.seq_len);
  return h;
}

}  // namespace train
}  // namespace meshtrain
