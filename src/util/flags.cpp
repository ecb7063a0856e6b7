#include "util/flags.h"

#include <cstdlib>
#include <sstream>

#include <algorithm>
#include <cmath>

namespace meshtrain {
namespace flags {

int64_t to_int64(const std::string& flag, const std::string& value) {
  try {
    size_t pos = 0;
    const long long x = std::stoll(value, &pos);
    if (pos == value.size()) return x;
  } catch (const std::exception&) {
  }
  throw ConfigError(str_cat(flag, " '", value, "' is not an integer"));
}

double to_finite(const std::string& flag, const std::string& value) {
  try {
    size_t pos = 0;
    const double x = std::stod(value, &pos);
    if (pos == value.size() && std::isfinite(x)) return x;  // no flag means inf or nan
  } catch (const std::exception&) {
  }
  throw ConfigError(str_cat(flag, " '", value, "' is not a finite number"));
}

std::string with_default(const std::string& help, const std::string& value) {
  if (value.empty() || help.find("default") != std::string::npos) return help;
  return help + " (default " + value + ")";
}

std::string shortest_text(double x) {
  std::ostringstream out;
  for (int digits = 6; digits <= 17; ++digits) {
    out.str("");
    out.precision(digits);
    out << x;
    if (std::strtod(out.str().c_str(), nullptr) == x) break;
  }
  return out.str();
}

Flag turn(const std::string& name, const std::string& help, bool& field, bool to) {
  return Flag{name, "", help, [&field, to](const std::string&, const std::string&) { field = to; },
              [&field, to] { return field == to ? std::string("true") : std::string(); }};
}

Parser::Parser(std::string tool, std::string synopsis, std::vector<Group> groups, std::string epilogue)
    : tool_(std::move(tool)), synopsis_(std::move(synopsis)), epilogue_(std::move(epilogue)), groups_(std::move(groups)) {}

Parser& Parser::rest_is_a_command() {
  rest_is_a_command_ = true;
  return *this;
}

Parser& Parser::takes_operands() {
  takes_operands_ = true;
  return *this;
}

Parser& Parser::underscores_as_dashes() {
  underscores_as_dashes_ = true;
  return *this;
}

std::string Parser::usage() const {
  std::string out = synopsis_;
  for (const Group& g : groups_) {
    out += g.title.empty() ? "" : "\n" + g.title + ":\n";
    for (const Flag& f : g.flags) {
      std::string left = "  " + f.name + (f.value.empty() ? "" : " " + f.value);
      left.resize(std::max<size_t>(left.size() + 2, 40), ' ');
      out += left + f.help + "\n";
    }
  }
  out += "  --help                                this text\n";
  return out + (epilogue_.empty() ? "" : "\n" + epilogue_);
}

const Flag* Parser::find(const std::string& name) const {
  for (const Group& g : groups_)
    for (const Flag& f : g.flags)
      if (f.name == name) return &f;
  return nullptr;
}

std::vector<std::string> Parser::parse(const std::vector<std::string>& args) const {
  const std::string prefix = tool_.empty() ? "" : tool_ + ": ";
  std::vector<std::string> operands;
  for (size_t i = 0; i < args.size(); ++i) {
    const bool flag = args[i] != "--" && args[i].rfind("-", 0) == 0;
    if (rest_is_a_command_ && !flag) return std::vector<std::string>(args.begin() + i + (args[i] == "--"), args.end());
    if (takes_operands_ && args[i] == "--") {
      operands.insert(operands.end(), args.begin() + i + 1, args.end());
      break;
    }
    if (takes_operands_ && !flag) {
      operands.push_back(args[i]);
      continue;
    }
    MESHTRAIN_CHECK(args[i].rfind("--", 0) == 0, prefix, "unexpected argument '", args[i],
                    "'; flags look like --steps 10 (", tool_.empty() ? "--help" : tool_ + " --help", " lists them)");
    const size_t eq = args[i].find('=');
    std::string name = args[i].substr(0, eq);
    if (underscores_as_dashes_) std::replace(name.begin() + 2, name.end(), '_', '-');
    const Flag* f = find(name);
    MESHTRAIN_CHECK(f, prefix, "unknown flag '", args[i], "'\n", usage());
    std::string value;
    if (f->value.empty()) {
      MESHTRAIN_CHECK(eq == std::string::npos, prefix, name, " takes no value; write just ", name);
    } else if (eq != std::string::npos) {
      value = args[i].substr(eq + 1);
    } else {
      MESHTRAIN_CHECK(i + 1 < args.size(), prefix, name, " needs a value, e.g. ", name, " ", f->value);
      const std::string& next = args[i + 1];
      MESHTRAIN_CHECK(next.rfind("--", 0) != 0 || !find(next.substr(0, next.find('='))), prefix, name,
                      " needs a value before the next flag ", next, ", e.g. ", name, " ", f->value);
      value = args[++i];
    }
    try {
      f->set(name, value);
    } catch (const ConfigError& e) {
      const std::string what = e.what();
      throw ConfigError(what.rfind(prefix, 0) == 0 ? what : prefix + what);
    }
  }
  return operands;
}

bool Parser::asks_for_help(const std::vector<std::string>& args) const {
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--help" || a == "-h") return true;
    if (rest_is_a_command_ && (a == "--" || a.rfind("-", 0) != 0)) return false;  // the program's own --help
    const Flag* f = find(a);
    if (f && !f->value.empty()) ++i;  // its value
  }
  return false;
}

}  // namespace flags
}  // namespace meshtrain
