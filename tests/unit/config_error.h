#pragma once
// What a call raises as a ConfigError ("" when it returns): the unit tests'
// way to check that bad input is refused with a message naming the value.

#include <functional>
#include <string>

#include "meshtrain/util.h"

namespace meshtrain {
namespace testing {

inline std::string config_error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

}  // namespace testing
}  // namespace meshtrain
