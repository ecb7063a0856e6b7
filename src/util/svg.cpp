#include "util/svg.h"

#include <fstream>
#include <sstream>

#include "meshtrain/util.h"

namespace meshtrain {
namespace svg {

namespace {

std::string escaped(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      default: out += c;
    }
  }
  return out;
}

std::string number(double v) {
  std::ostringstream s;
  s << v;
  return s.str();
}

std::string style_attributes(const Style& style) {
  std::string out = " fill=\"" + style.fill + "\"";
  if (!style.stroke.empty()) out += " stroke=\"" + style.stroke + "\"";
  if (!style.stroke.empty() && style.stroke_width != 1) out += " stroke-width=\"" + number(style.stroke_width) + "\"";
  return out;
}

}  // namespace

Document::Document(int width, int height, int font_size) {
  body_ = "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" + std::to_string(width) + "\" height=\"" +
          std::to_string(height) + "\" font-family=\"sans-serif\" font-size=\"" + std::to_string(font_size) +
          "\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
}

Document& Document::rect(double x, double y, double w, double h, const Style& style) {
  body_ += "<rect x=\"" + number(x) + "\" y=\"" + number(y) + "\" width=\"" + number(w) + "\" height=\"" + number(h) +
           "\"" + style_attributes(style) + "/>\n";
  return *this;
}

Document& Document::line(double x1, double y1, double x2, double y2, const std::string& stroke) {
  body_ += "<line x1=\"" + number(x1) + "\" y1=\"" + number(y1) + "\" x2=\"" + number(x2) + "\" y2=\"" + number(y2) +
           "\" stroke=\"" + stroke + "\"/>\n";
  return *this;
}

Document& Document::polyline(const std::vector<std::pair<double, double>>& points, const Style& style) {
  body_ += "<polyline" + style_attributes(style) + " points=\"";
  for (const auto& p : points) body_ += number(p.first) + "," + number(p.second) + " ";
  body_ += "\"/>\n";
  return *this;
}

Document& Document::text(double x, double y, const std::string& content, const std::string& anchor, int font_size,
                         const std::string& fill) {
  body_ += "<text x=\"" + number(x) + "\" y=\"" + number(y) + "\"";
  if (anchor != "start") body_ += " text-anchor=\"" + anchor + "\"";
  if (font_size > 0) body_ += " font-size=\"" + std::to_string(font_size) + "\"";
  if (!fill.empty()) body_ += " fill=\"" + fill + "\"";
  body_ += ">" + escaped(content) + "</text>\n";
  return *this;
}

void Document::write(const std::string& path, const std::string& what) const {
  std::ofstream out(path);
  MESHTRAIN_CHECK(out.good(), what, ": cannot write ", path);
  out << str();
  MESHTRAIN_CHECK(out.good(), what, ": writing ", path, " failed");
}

}  // namespace svg
}  // namespace meshtrain
