#pragma once
// `meshtrain generate`: text from a built-in language model (published
// weights or a training checkpoint of any layout), in one process, with a
// cache of keys and values (meshtrain/models.h).

#include <ostream>
#include <string>
#include <vector>

namespace meshtrain {
namespace train {

// Parses the flags, loads the model, generates; returns the exit code.
int run_generate_command(const std::vector<std::string>& args, std::ostream& out);

}  // namespace train
}  // namespace meshtrain
