#pragma once
// The data flags (--data, --val-data, --val-batches, --no-shuffle,
// --eval-every and the vocabulary the shards record) resolved and checked
// against the model before any communication (internal to train::resolve).

#include "app/trainer/config.h"

namespace meshtrain {
namespace train {

// Sets the model's vocabulary from the token shards' headers when --vocab was
// not given (and a text file's 256 byte tokens), and checks every data file.
// ConfigError naming the file, the value and the fix.
void resolve_data(TrainConfig& config);

}  // namespace train
}  // namespace meshtrain
