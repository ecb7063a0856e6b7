#pragma once
// JSON: objects written as text in field order, and a parsed tree to read
// (nlohmann-json underneath: strict, every escape, exact numbers).

#include <cstdint>
#include <map>
#include <sstream>
#include <string>
#include <vector>

namespace meshtrain {
namespace json {

std::string quote(const std::string& s);
std::string number(double v);

// An object under construction: add fields in order, str() closes it.
class Object {
 public:
  Object& raw(const std::string& key, const std::string& json_value);
  Object& str(const std::string& key, const std::string& value) { return raw(key, quote(value)); }
  Object& num(const std::string& key, double value) { return raw(key, number(value)); }
  Object& integer(const std::string& key, long long value) { return raw(key, std::to_string(value)); }
  Object& boolean(const std::string& key, bool value) { return raw(key, value ? "true" : "false"); }
  std::string str() const { return "{" + body_ + "}"; }

 private:
  std::string body_;
};

std::string array(const std::vector<std::string>& json_values);
std::string numbers(const std::vector<double>& values);

// A parsed JSON value (for manifests, metrics and tests).
class Value {
 public:
  enum class Type { kNull, kBool, kNumber, kString, kArray, kObject };
  Type type = Type::kNull;
  bool boolean = false;
  double number = 0;
  bool is_integer = false;  // written without a fraction or exponent: `integer` holds it exactly
  int64_t integer = 0;
  std::string string;
  std::vector<Value> items;
  std::map<std::string, Value> fields;

  // Object field; throws ConfigError naming the key when absent.
  const Value& operator[](const std::string& key) const;
  const Value& operator[](size_t index) const;
  bool has(const std::string& key) const { return fields.count(key) > 0; }
  double num() const;
  int64_t i64() const;  // an integer, exactly (counts, offsets, bytes); ConfigError otherwise
  const std::string& str() const;
  size_t size() const { return type == Type::kArray ? items.size() : fields.size(); }
};

// Parses JSON text; throws ConfigError with the position on malformed input.
Value parse(const std::string& text);
// Reads and parses a file; errors name it.
Value parse_file(const std::string& path);

}  // namespace json
}  // namespace meshtrain
