#pragma once
// `meshtrain data`: text files made into token shards (meshtrain/data.h).

#include <ostream>
#include <string>
#include <vector>

namespace meshtrain {
namespace train {

// `meshtrain data --out PREFIX [--tokenizer SPEC | --train-tokenizer N]
// [--per-line] [--val-fraction F] [--shard-tokens N] FILE...`; returns the exit code.
int run_data_command(const std::vector<std::string>& args, std::ostream& out);

}  // namespace train
}  // namespace meshtrain
