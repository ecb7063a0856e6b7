#pragma once
// A directory of a unit test's own under /tmp, removed when the test ends,
// and a file written into it.

#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <string>

#include "util/files.h"

namespace meshtrain {
namespace testing {

struct Scratch {
  explicit Scratch(const std::string& name) : dir("/tmp/meshtrain-unit-" + std::to_string(getpid()) + "-" + name) {
    files::remove_tree(dir);
    files::make_directories(dir);
  }
  ~Scratch() { files::remove_tree(dir); }
  // Writes `text` to dir/name and returns the path.
  std::string file(const std::string& name, const std::string& text) const {
    std::ofstream(dir + "/" + name, std::ios::binary) << text;
    return dir + "/" + name;
  }
  std::string operator+(const std::string& tail) const { return dir + tail; }
  std::string dir;
};

}  // namespace testing
}  // namespace meshtrain
