#pragma once
// The command-line parser of meshtrain's three tools (the trainer, `meshtrain
// plan`, meshrun), so that a flag reads the same way everywhere:
//   --flag VALUE and --flag=VALUE; a switch takes no value (--json=yes is an
//   error); given twice, the last one wins (argparse's and torchrun's habit);
//   an unknown flag is named, with the usage; --help / -h: the usage, generated
//   from the table (every flag with its one-line help and default).
// Numbers are read whole and in the target's range: "4294967297" is not an
// int, "12abc" is not a number, and floats must be finite.
// Errors are ConfigError, prefixed with the tool's name.

#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "meshtrain/util.h"

namespace meshtrain {
namespace flags {

// The whole string as an integer; ConfigError "--flag 'v' is not an integer".
int64_t to_int64(const std::string& flag, const std::string& value);
// The whole string as a finite number; ConfigError "--flag 'v' is not a finite number".
double to_finite(const std::string& flag, const std::string& value);

// An integer in T's range: --steps 4294967297 is not 1.
template <typename T>
T to_integer(const std::string& flag, const std::string& value) {
  static_assert(std::is_integral<T>::value, "to_integer: an integer type");
  const int64_t x = to_int64(flag, value);
  const bool wide = !std::is_signed<T>::value && sizeof(T) >= sizeof(int64_t);  // uint64: any x >= 0 fits
  MESHTRAIN_CHECK(x >= static_cast<int64_t>(std::numeric_limits<T>::min()) &&
                      (wide || x <= static_cast<int64_t>(std::numeric_limits<T>::max())),
                  flag, " ", value, " is out of range (", +std::numeric_limits<T>::min(), " to ",
                  +std::numeric_limits<T>::max(), ")");
  return static_cast<T>(x);
}

// A flag's value as the field's type: strings as given, numbers checked.
template <typename T>
T to_value(const std::string& flag, const std::string& value) {
  if constexpr (std::is_same<T, std::string>::value) return value;
  else if constexpr (std::is_floating_point<T>::value) return static_cast<T>(to_finite(flag, value));
  else return to_integer<T>(flag, value);
}

struct Flag {
  std::string name;   // "--steps"
  std::string value;  // the value's placeholder in the usage ("N"); empty: a switch
  std::string help;   // one line, with the default
  std::function<void(const std::string& flag, const std::string& value)> set;
  // The value now, as it would be given ("" for a switch that is off, "true"
  // for one that is on); unset: the flag has none to show (a configuration
  // dump skips it).
  std::function<std::string()> get = nullptr;
  bool text = false;  // get() is text, not a number (a dump quotes it)
};

struct Group {
  std::string title;  // "" : no heading
  std::vector<Flag> flags;
};

// "help (default X)" from the field's value now, unless the help already says its default.
std::string with_default(const std::string& help, const std::string& value);
// The shortest text that reads back as x (0.1, not 0.10000000000000001).
std::string shortest_text(double x);
template <typename T>
std::string default_text(const T& field) {
  if constexpr (std::is_same<T, std::string>::value) return field;
  else if constexpr (std::is_floating_point<T>::value) return shortest_text(field);
  else return str_cat(+field);  // uint8_t as a number
}

// A flag that stores its value, read as the field's type, into `field`; its
// help ends with the field's current value as the default.
template <typename T>
Flag store(const std::string& name, const std::string& value, const std::string& help, T& field) {
  return Flag{name, value, with_default(help, default_text(field)),
              [&field](const std::string& f, const std::string& v) { field = to_value<T>(f, v); },
              [&field] { return default_text(field); }, std::is_same<T, std::string>::value};
}
// A switch that sets `field` to `to`.
Flag turn(const std::string& name, const std::string& help, bool& field, bool to = true);

class Parser {
 public:
  // tool: the error prefix ("meshrun"); synopsis: the usage's first lines;
  // epilogue: lines after the flags.
  Parser(std::string tool, std::string synopsis, std::vector<Group> groups, std::string epilogue = "");
  // meshrun: "--" or the first word that is not a flag ends the flags; parse() returns the rest.
  Parser& rest_is_a_command();
  // meshtrain data: words that are not flags (files), anywhere, are returned by parse().
  Parser& takes_operands();
  // torchrun's spelling: --nproc_per_node is --nproc-per-node.
  Parser& underscores_as_dashes();

  std::string usage() const;
  const std::vector<Group>& groups() const { return groups_; }
  // The flag of that name ("--steps"), or null.
  const Flag* find(const std::string& name) const;
  // Sets each flag given, in order. Returns the command (rest_is_a_command),
  // the operands (takes_operands) or nothing: a word that is not a flag is an
  // error otherwise.
  std::vector<std::string> parse(const std::vector<std::string>& args) const;
  // Whether args ask for --help (-h) among the flags (not in meshrun's command).
  bool asks_for_help(const std::vector<std::string>& args) const;

 private:
  std::string tool_, synopsis_, epilogue_;
  std::vector<Group> groups_;
  bool rest_is_a_command_ = false;
  bool takes_operands_ = false;
  bool underscores_as_dashes_ = false;
};

}  // namespace flags
}  // namespace meshtrain
