#pragma once
// Small string helpers for flag and environment parsing.

#include <string>
#include <vector>

namespace meshtrain {

// "a,b,,c" -> {"a", "b", "", "c"}; "" -> {""}.
inline std::vector<std::string> split(const std::string& text, char separator) {
  std::vector<std::string> parts;
  size_t begin = 0;
  while (true) {
    const size_t end = text.find(separator, begin);
    parts.push_back(text.substr(begin, end == std::string::npos ? std::string::npos : end - begin));
    if (end == std::string::npos) return parts;
    begin = end + 1;
  }
}

// {"a", "b"}, ", " -> "a, b".
inline std::string join(const std::vector<std::string>& parts, const std::string& separator) {
  std::string text;
  for (size_t i = 0; i < parts.size(); ++i) text += (i ? separator : "") + parts[i];
  return text;
}

// Without leading and trailing whitespace (a file's trailing newline).
inline std::string trim(const std::string& text) {
  const char* space = " \t\r\n";
  const size_t begin = text.find_first_not_of(space);
  if (begin == std::string::npos) return "";
  return text.substr(begin, text.find_last_not_of(space) - begin + 1);
}

}  // namespace meshtrain
