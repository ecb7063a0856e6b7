#pragma once
// A run described by a file, as torchtitan's users keep one per run:
// `meshtrain --config run.toml [flags]` and `meshtrain config --dump [flags]`
// (Note [A run in a TOML file]).

#include <iosfwd>
#include <string>
#include <vector>

#include "util/flags.h"

namespace meshtrain {
namespace train {

// args with the flags of --config FILE (when given) placed before them, so
// that the command line's override the file's (the last flag wins). Every key
// must be one of parser's flags; ConfigError names the file, the line and the
// key otherwise, and a file TOML cannot read.
std::vector<std::string> with_config_file(const std::vector<std::string>& args, const flags::Parser& parser);

// The flags of `now` whose values differ from `defaults`' (two parsers of the
// same table) as TOML, one section per group of flags: what --config reads
// back into the same run.
std::string dump_toml(const flags::Parser& now, const flags::Parser& defaults);

// `meshtrain config --dump [flags]`.
int run_config_command(const std::vector<std::string>& args, std::ostream& out);

}  // namespace train
}  // namespace meshtrain
