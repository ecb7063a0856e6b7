#pragma once
// Errors shared by every layer. Bad configuration is rejected with ConfigError
// before any communication; the message names the value, what was expected and
// what to do (see STYLE: "Errors").

#include <sstream>
#include <stdexcept>
#include <string>

namespace meshtrain {

// A user-supplied value (flag, option, environment variable, tensor argument)
// is invalid. Thrown before any communication starts.
class ConfigError : public std::invalid_argument {
 public:
  explicit ConfigError(const std::string& what) : std::invalid_argument(what) {}
};

namespace detail {
inline void append_all(std::ostringstream&) {}
template <typename T, typename... Rest>
void append_all(std::ostringstream& os, const T& first, const Rest&... rest) {
  os << first;
  append_all(os, rest...);
}
}  // namespace detail

// Concatenates its arguments with operator<<.
template <typename... Args>
std::string str_cat(const Args&... args) {
  std::ostringstream os;
  detail::append_all(os, args...);
  return os.str();
}

}  // namespace meshtrain

// Throws meshtrain::ConfigError with the concatenated message when cond is false.
#define MESHTRAIN_CHECK(cond, ...)                                  \
  do {                                                              \
    if (!(cond)) {                                                  \
      throw ::meshtrain::ConfigError(::meshtrain::str_cat(__VA_ARGS__)); \
    }                                                               \
  } while (0)
