#pragma once
// Pipeline timelines (pure): the measured bubble, a Chrome trace (opens in
// Perfetto / chrome://tracing) and an SVG like the article's schedule picture:
// ranks as rows, forwards and backwards in distinct colours with their
// micro-batch numbers, idle time blank.

#include <string>
#include <vector>

#include "meshtrain/pp.h"

namespace meshtrain {
namespace pp {

struct BubbleStats {
  double span = 0;                 // from the first start to the last end, over all ranks (s)
  std::vector<double> busy;        // per rank (s)
  double bubble = 0;               // mean over ranks of 1 - busy / span
};

BubbleStats bubble_of(const std::vector<TraceEvent>& events, int ranks);
std::string chrome_trace_json(const std::vector<TraceEvent>& events);
std::string schedule_svg(const std::vector<TraceEvent>& events, int ranks, const std::string& title);
// Writes FILE (Chrome trace) and FILE with ".json" replaced by (or ".svg" appended as) the SVG; returns the SVG's path.
std::string write_trace_files(const std::string& path, const std::vector<TraceEvent>& events, int ranks,
                              const std::string& title);

}  // namespace pp
}  // namespace meshtrain
