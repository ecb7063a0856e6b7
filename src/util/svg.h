#pragma once
// A minimal SVG writer for the plots meshtrain draws (the loss curve, the
// pipeline timeline): shapes and text on a white page, text escaped.

#include <string>
#include <utility>
#include <vector>

namespace meshtrain {
namespace svg {

struct Style {
  std::string fill = "none";
  std::string stroke;  // empty: none
  double stroke_width = 1;
};

class Document {
 public:
  Document(int width, int height, int font_size);
  Document& rect(double x, double y, double w, double h, const Style& style);
  Document& line(double x1, double y1, double x2, double y2, const std::string& stroke);
  Document& polyline(const std::vector<std::pair<double, double>>& points, const Style& style);
  // anchor: "start", "middle" or "end"; font_size 0: the document's.
  Document& text(double x, double y, const std::string& content, const std::string& anchor = "start",
                 int font_size = 0, const std::string& fill = "");
  std::string str() const { return body_ + "</svg>\n"; }
  // Writes the document to `path`; `what` names the file in the error.
  void write(const std::string& path, const std::string& what) const;

 private:
  std::string body_;
};

}  // namespace svg
}  // namespace meshtrain
