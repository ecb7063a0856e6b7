#include "meshtrain/util/json.h"

#include <cmath>
#include <cstdio>

namespace meshtrain {
namespace json {

std::string quote(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", c);
          out += buf;
        } else {
          out += c;
        }
    }
  }
  return out + "\"";
}

std::string number(double v) {
  if (!std::isfinite(v)) return "null";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.9g", v);
  return buf;
}

Object& Object::raw(const std::string& key, const std::string& json_value) {
  if (!body_.empty()) body_ += ", ";
  body_ += quote(key) + ": " + json_value;
  return *this;
}

std::string array(const std::vector<std::string>& values) {
  std::string out = "[";
  for (size_t i = 0; i < values.size(); ++i) out += (i ? ", " : "") + values[i];
  return out + "]";
}

std::string numbers(const std::vector<double>& values) {
  std::vector<std::string> parts;
  for (double v : values) parts.push_back(number(v));
  return array(parts);
}

}  // namespace json
}  // namespace meshtrain
