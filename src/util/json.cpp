// JSON through nlohmann-json: strict parsing (no NaN, hex or trailing text;
// every escape, \uXXXX included), numbers written to round-trip exactly,
// integers read exactly. meshtrain's small API in front of it.
#include "meshtrain/util.h"

#include <nlohmann/json.hpp>

#include <cmath>

#include "util/files.h"

namespace meshtrain {
namespace json {

namespace {

using nl = nlohmann::json;

Value from(const nl& j) {
  Value v;
  switch (j.type()) {
    case nl::value_t::null: v.type = Value::Type::kNull; break;
    case nl::value_t::boolean: v.type = Value::Type::kBool; v.boolean = j.get<bool>(); break;
    case nl::value_t::number_integer:
    case nl::value_t::number_unsigned:
      v.type = Value::Type::kNumber;
      v.is_integer = true;
      v.integer = j.get<int64_t>();
      v.number = static_cast<double>(v.integer);
      break;
    case nl::value_t::number_float: v.type = Value::Type::kNumber; v.number = j.get<double>(); break;
    case nl::value_t::string: v.type = Value::Type::kString; v.string = j.get<std::string>(); break;
    case nl::value_t::array:
      v.type = Value::Type::kArray;
      for (const nl& item : j) v.items.push_back(from(item));
      break;
    case nl::value_t::object:
      v.type = Value::Type::kObject;
      for (auto it = j.begin(); it != j.end(); ++it) v.fields[it.key()] = from(it.value());
      break;
    default: throw ConfigError("JSON: unsupported value (binary)");
  }
  return v;
}

}  // namespace

std::string quote(const std::string& s) {
  // Invalid UTF-8 (a path's bytes, say) becomes U+FFFD rather than failing the write.
  return nl(s).dump(-1, ' ', false, nl::error_handler_t::replace);
}

std::string number(double v) {
  if (!std::isfinite(v)) return "null";  // JSON has no NaN or infinity
  return nl(v).dump();                   // the shortest text that reads back as the same double
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

const Value& Value::operator[](const std::string& key) const {
  auto it = fields.find(key);
  MESHTRAIN_CHECK(type == Type::kObject && it != fields.end(), "JSON: no field '", key, "'");
  return it->second;
}

const Value& Value::operator[](size_t index) const {
  MESHTRAIN_CHECK(type == Type::kArray && index < items.size(), "JSON: no item ", index);
  return items[index];
}

double Value::num() const {
  MESHTRAIN_CHECK(type == Type::kNumber || type == Type::kNull, "JSON: not a number");
  return type == Type::kNull ? std::nan("") : number;
}

int64_t Value::i64() const {
  MESHTRAIN_CHECK(type == Type::kNumber && is_integer, "JSON: not an integer (", type == Type::kNumber ? number : 0.0, ")");
  return integer;
}

const std::string& Value::str() const {
  MESHTRAIN_CHECK(type == Type::kString, "JSON: not a string");
  return string;
}

Value parse(const std::string& text) {
  try {
    return from(nl::parse(text));
  } catch (const nl::exception& e) {
    throw ConfigError(str_cat("JSON: ", e.what()));
  }
}

Value parse_file(const std::string& path) {
  MESHTRAIN_CHECK(files::exists(path), path, ": no such file");
  try {
    return from(nl::parse(files::read_all(path)));
  } catch (const nl::exception& e) {
    throw ConfigError(str_cat(path, ": not valid JSON (", e.what(), ")"));
  }
}

}  // namespace json
}  // namespace meshtrain
