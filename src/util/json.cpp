#include "meshtrain/util/json.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "meshtrain/util/error.h"

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

const std::string& Value::str() const {
  MESHTRAIN_CHECK(type == Type::kString, "JSON: not a string");
  return string;
}

namespace {

struct Parser {
  const std::string& t;
  size_t i = 0;
  void ws() {
    while (i < t.size() && (t[i] == ' ' || t[i] == '\n' || t[i] == '\t' || t[i] == '\r')) ++i;
  }
  [[noreturn]] void fail(const char* what) { throw ConfigError(str_cat("JSON: ", what, " at offset ", i)); }
  void expect(char c) {
    ws();
    if (i >= t.size() || t[i] != c) fail("unexpected character");
    ++i;
  }
  std::string string_literal() {
    expect('"');
    std::string out;
    while (i < t.size() && t[i] != '"') {
      char c = t[i++];
      if (c == '\\' && i < t.size()) {
        const char e = t[i++];
        if (e == 'n') c = '\n';
        else if (e == 't') c = '\t';
        else if (e == 'u' && i + 4 <= t.size()) {
          c = static_cast<char>(std::strtol(t.substr(i, 4).c_str(), nullptr, 16));
          i += 4;
        } else c = e;
      }
      out.push_back(c);
    }
    if (i >= t.size()) fail("unterminated string");
    ++i;
    return out;
  }
  Value value() {
    ws();
    if (i >= t.size()) fail("unexpected end");
    Value v;
    const char c = t[i];
    if (c == '{') {
      v.type = Value::Type::kObject;
      ++i;
      ws();
      if (i < t.size() && t[i] == '}') { ++i; return v; }
      while (true) {
        std::string key = string_literal();
        expect(':');
        v.fields[key] = value();
        ws();
        if (i < t.size() && t[i] == ',') { ++i; continue; }
        expect('}');
        return v;
      }
    }
    if (c == '[') {
      v.type = Value::Type::kArray;
      ++i;
      ws();
      if (i < t.size() && t[i] == ']') { ++i; return v; }
      while (true) {
        v.items.push_back(value());
        ws();
        if (i < t.size() && t[i] == ',') { ++i; continue; }
        expect(']');
        return v;
      }
    }
    if (c == '"') {
      v.type = Value::Type::kString;
      v.string = string_literal();
      return v;
    }
    if (t.compare(i, 4, "true") == 0) { i += 4; v.type = Value::Type::kBool; v.boolean = true; return v; }
    if (t.compare(i, 5, "false") == 0) { i += 5; v.type = Value::Type::kBool; return v; }
    if (t.compare(i, 4, "null") == 0) { i += 4; return v; }
    char* end = nullptr;
    v.number = std::strtod(t.c_str() + i, &end);
    if (end == t.c_str() + i) fail("not a JSON value");
    i = static_cast<size_t>(end - t.c_str());
    v.type = Value::Type::kNumber;
    return v;
  }
};

}  // namespace

Value parse(const std::string& text) {
  Parser p{text};
  Value v = p.value();
  p.ws();
  if (p.i != text.size()) p.fail("trailing characters");
  return v;
}

}  // namespace json
}  // namespace meshtrain
