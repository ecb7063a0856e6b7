#pragma once
// The resolved configuration as TOML, in sections like torchtitan's
// ([model], [parallelism], [training], [optimizer], [data], [comm]): what the
// trainer prints at start, one key a line.

#include <string>

#include "app/trainer/config.h"

namespace meshtrain {
namespace train {

std::string to_toml(const TrainConfig& c);

}  // namespace train
}  // namespace meshtrain
