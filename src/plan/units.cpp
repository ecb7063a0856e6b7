#include "plan/units.h"

#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <utility>

#include "meshtrain/util.h"

namespace meshtrain {
namespace plan {

namespace {

// Splits "80GB" into 80 and "GB". The text must start with a decimal digit
// (strtod alone would also take "inf", "nan" and "0x..", which no size means).
std::pair<double, std::string> split_number(const std::string& flag, const std::string& text,
                                            const std::string& example) {
  const bool hex = text.size() > 1 && text[0] == '0' && (text[1] == 'x' || text[1] == 'X');
  const bool decimal = !text.empty() && (std::isdigit(static_cast<unsigned char>(text[0])) || text[0] == '.') && !hex;
  char* end = nullptr;
  const double value = decimal ? std::strtod(text.c_str(), &end) : 0;
  MESHTRAIN_CHECK(decimal && end != text.c_str() && std::isfinite(value) && value > 0, flag, " '", text,
                  "': expected a positive number, e.g. ", flag, " ", example);
  std::string rest(end);
  while (!rest.empty() && rest.front() == ' ') rest.erase(rest.begin());
  return {value, rest};
}

// Bytes per unit, or 0 when the unit is unknown.
double unit_bytes(const std::string& unit) {
  static const std::pair<const char*, double> kUnits[] = {
      {"B", 1.0},         {"KB", 1e3},           {"MB", 1e6},
      {"GB", 1e9},        {"TB", 1e12},          {"KiB", 1024.0},
      {"MiB", 1048576.0}, {"GiB", 1073741824.0}, {"TiB", 1099511627776.0}};
  for (const auto& u : kUnits)
    if (unit == u.first) return u.second;
  return 0;
}

const char* kByteUnits = "B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024)";

}  // namespace

int64_t parse_bytes(const std::string& flag, const std::string& text) {
  const auto [value, unit] = split_number(flag, text, "80GB");
  MESHTRAIN_CHECK(!unit.empty(), flag, " '", text, "' has no unit; write e.g. ", text, "GB (units: ", kByteUnits, ")");
  const double scale = unit_bytes(unit);
  MESHTRAIN_CHECK(scale > 0, flag, " '", text, "': unknown unit '", unit, "'; use ", kByteUnits, ", e.g. 80GB");
  MESHTRAIN_CHECK(value * scale >= 1 && value * scale < 9e18, flag, " '", text,
                  "' is out of range; expected between 1B and 9EB");
  return std::llround(value * scale);
}

double parse_bandwidth(const std::string& flag, const std::string& text) {
  const auto [value, unit] = split_number(flag, text, "25GB/s");
  const bool per_second = unit.size() > 2 && unit.compare(unit.size() - 2, 2, "/s") == 0;
  const double scale = per_second ? unit_bytes(unit.substr(0, unit.size() - 2)) : 0;
  MESHTRAIN_CHECK(scale > 0, flag, " '", text, "': expected bytes per second with a unit among ", kByteUnits,
                  ", followed by /s, e.g. 25GB/s (a 200 Gb/s InfiniBand link is 25GB/s)");
  return value * scale;
}

int64_t parse_count(const std::string& flag, const std::string& text) {
  const auto [value, suffix] = split_number(flag, text, "7.5B");
  double scale = 0;
  if (suffix.empty()) scale = 1;
  if (suffix == "K" || suffix == "k") scale = 1e3;
  if (suffix == "M" || suffix == "m") scale = 1e6;
  if (suffix == "B" || suffix == "b") scale = 1e9;
  if (suffix == "T" || suffix == "t") scale = 1e12;
  MESHTRAIN_CHECK(scale > 0, flag, " '", text, "': unknown suffix '", suffix,
                  "'; use a plain number (7.5e9) or K, M, B, T (thousand, million, billion, trillion), e.g. 7.5B");
  MESHTRAIN_CHECK(value * scale >= 1 && value * scale < 9e18, flag, " '", text, "' is out of range");
  return std::llround(value * scale);
}

int64_t parse_positive_int(const std::string& flag, const std::string& text) {
  bool digits_only = !text.empty() && text.size() <= 18;
  for (char c : text) digits_only = digits_only && std::isdigit(static_cast<unsigned char>(c));
  const int64_t value = digits_only ? std::stoll(text) : 0;
  MESHTRAIN_CHECK(value >= 1, flag, " '", text, "': expected a whole number >= 1, e.g. ", flag, " 8");
  return value;
}

std::string with_commas(int64_t n) {
  std::string digits = std::to_string(n < 0 ? -n : n);
  for (int i = static_cast<int>(digits.size()) - 3; i > 0; i -= 3) digits.insert(static_cast<size_t>(i), ",");
  return (n < 0 ? "-" : "") + digits;
}

std::string gigabytes(double bytes, int decimals) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", decimals, bytes / 1e9);
  return buf;
}

std::string seconds_text(double seconds) {
  char buf[64];
  std::snprintf(buf, sizeof buf, seconds < 10 ? "%.3f" : "%.1f", seconds);
  return buf;
}

std::string a_or_an(const std::string& n) {
  // 8, 80, 800...; 11 and 18 (and 11,000...) are said "eleven", "eighteen".
  const bool vowel = !n.empty() && (n[0] == '8' || n.rfind("11", 0) == 0 || n.rfind("18", 0) == 0) &&
                     !(n.size() > 2 && std::isdigit(static_cast<unsigned char>(n[2])) && n[0] == '1');
  return vowel ? "an" : "a";
}

std::string tflops_text(double flops) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f", flops / 1e12);
  return buf;
}

}  // namespace plan
}  // namespace meshtrain
