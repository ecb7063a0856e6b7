#pragma once
// A command line written as one string, split at whitespace as a shell would
// (no quoting): the planner tests' way to write flags and to read the command
// the planner prints.

#include <sstream>
#include <string>
#include <vector>

namespace meshtrain {
namespace testing {

inline std::vector<std::string> split_args(const std::string& line) {
  std::istringstream is(line);
  std::vector<std::string> args;
  for (std::string word; is >> word;) args.push_back(word);
  return args;
}

}  // namespace testing
}  // namespace meshtrain
