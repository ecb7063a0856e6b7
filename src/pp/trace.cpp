#include "pp/trace.h"

#include <algorithm>
#include <cstdio>
#include <fstream>

#include "meshtrain/util.h"
#include "util/svg.h"

namespace meshtrain {
namespace pp {

BubbleStats bubble_of(const std::vector<TraceEvent>& events, int ranks) {
  BubbleStats s;
  s.busy.assign(ranks, 0.0);
  if (events.empty()) return s;
  double lo = events[0].start, hi = events[0].end;
  for (const auto& e : events) {
    lo = std::min(lo, e.start);
    hi = std::max(hi, e.end);
    if (e.rank >= 0 && e.rank < ranks) s.busy[e.rank] += e.end - e.start;
  }
  s.span = hi - lo;
  double idle = 0;
  for (double b : s.busy) idle += s.span > 0 ? 1.0 - b / s.span : 0.0;
  s.bubble = idle / ranks;
  return s;
}

std::string chrome_trace_json(const std::vector<TraceEvent>& events) {
  std::vector<std::string> items;
  for (const auto& e : events) {
    items.push_back(json::Object()
                        .str("name", std::to_string(e.stage) + (e.forward ? "F" : "B") + std::to_string(e.microbatch))
                        .str("cat", e.forward ? "forward" : "backward")
                        .str("ph", "X")
                        .num("ts", e.start * 1e6)
                        .num("dur", (e.end - e.start) * 1e6)
                        .integer("pid", 0)
                        .integer("tid", e.rank)
                        .raw("args", json::Object().integer("stage", e.stage).integer("microbatch", e.microbatch).str())
                        .str());
  }
  for (int r = 0, n = 0; r < 64 && n < static_cast<int>(events.size()); ++r) {
    bool any = false;
    for (const auto& e : events) any = any || e.rank == r;
    if (!any) continue;
    items.push_back(json::Object().str("name", "thread_name").str("ph", "M").integer("pid", 0).integer("tid", r)
                        .raw("args", json::Object().str("name", "rank " + std::to_string(r)).str()).str());
    ++n;
  }
  return json::Object().raw("traceEvents", json::array(items)).str("displayTimeUnit", "ms").str();
}

std::string schedule_svg(const std::vector<TraceEvent>& events, int ranks, const std::string& title) {
  const BubbleStats b = bubble_of(events, ranks);
  const double lo = events.empty() ? 0 : std::min_element(events.begin(), events.end(), [](auto& x, auto& y) { return x.start < y.start; })->start;
  const int W = 960, left = 70, right = 20, top = 46, row = 34, gap = 6;
  const int H = top + ranks * (row + gap) + 48;
  const double scale = b.span > 0 ? (W - left - right) / b.span : 1.0;
  char bubble[64];
  std::snprintf(bubble, sizeof bubble, ": bubble %.1f%% (measured)", 100 * b.bubble);
  svg::Document doc(W, H, 11);
  doc.text(left, 22, title + bubble, "start", 14);
  for (int r = 0; r < ranks; ++r) {
    const int y = top + r * (row + gap);
    doc.text(left - 8, y + row / 2 + 4, "rank " + std::to_string(r), "end").rect(left, y, W - left - right, row, {"#eeeeee", ""});
  }
  for (const auto& e : events) {
    const int y = top + e.rank * (row + gap);
    const double x = left + (e.start - lo) * scale, w = std::max(1.0, (e.end - e.start) * scale);
    doc.rect(x, y, w, row, {e.forward ? "#1f77b4" : "#ff7f0e", "white"})
        .text(x + w / 2, y + row / 2 + 4, std::to_string(e.microbatch), "middle", 0, "white");
  }
  const int ly = top + ranks * (row + gap) + 14;
  const char* legend[][2] = {{"#1f77b4", "forward (micro-batch)"}, {"#ff7f0e", "backward"}, {"#eeeeee", "idle (bubble)"}};
  for (int i = 0; i < 3; ++i) doc.rect(left + 180 * i, ly, 14, 14, {legend[i][0], ""}).text(left + 180 * i + 20, ly + 11, legend[i][1]);
  char total[64];
  std::snprintf(total, sizeof total, "time: %.1f ms in all", b.span * 1e3);
  doc.text(left + 520, ly + 11, total);
  return doc.str();
}

std::string write_trace_files(const std::string& path, const std::vector<TraceEvent>& events, int ranks,
                              const std::string& title) {
  std::ofstream(path) << chrome_trace_json(events) << "\n";
  std::string svg = path;
  if (svg.size() > 5 && svg.compare(svg.size() - 5, 5, ".json") == 0) svg = svg.substr(0, svg.size() - 5);
  svg += ".svg";
  std::ofstream out(svg);
  MESHTRAIN_CHECK(out.good(), "--trace: cannot write ", svg);
  out << schedule_svg(events, ranks, title);
  MESHTRAIN_CHECK(out.good(), "--trace: writing ", svg, " failed");
  return svg;
}

}  // namespace pp
}  // namespace meshtrain
