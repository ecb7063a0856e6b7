#pragma once
// Parsing and printing of the planner's quantities: byte sizes ("80GB",
// "64GiB"), bandwidths ("300GB/s") and parameter counts ("7.5B", "350M").
// Every parse error is a ConfigError that names the flag, the text, what was
// expected and an example.

#include <cstdint>
#include <string>

namespace meshtrain {
namespace plan {

// "80GB" -> 80e9. Units: B, KB, MB, GB, TB (powers of 1000) and KiB, MiB,
// GiB, TiB (powers of 1024); a unit is required (a bare "80" is ambiguous).
int64_t parse_bytes(const std::string& flag, const std::string& text);

// "300GB/s" -> 3e11 bytes per second: a byte size (same units) followed by "/s".
double parse_bandwidth(const std::string& flag, const std::string& text);

// "7.5e9", "7.5B", "350M", "125K", "1.2T" -> a count (K, M, B, T = 1e3, 1e6,
// 1e9, 1e12; here B means billion, not bytes).
int64_t parse_count(const std::string& flag, const std::string& text);

// A whole number >= 1 ("24"; "24.5", "0" and "-3" are rejected).
int64_t parse_positive_int(const std::string& flag, const std::string& text);

// 1234567 -> "1,234,567".
std::string with_commas(int64_t n);

// Bytes as decimal gigabytes (1 GB = 1e9 B, as the ZeRO paper counts), with
// `decimals` digits: 16777216000 -> "16.8".
std::string gigabytes(double bytes, int decimals = 1);

// Seconds with three significant-looking digits: "0.036", "2.41", "1234.5".
std::string seconds_text(double seconds);

// FLOP/s as TFLOP/s with one decimal: 1.634e14 -> "163.4".
std::string tflops_text(double flops);

// "a 16 GB device", "an 80 GB device": the article for a number's sound.
std::string a_or_an(const std::string& number_text);

}  // namespace plan
}  // namespace meshtrain
