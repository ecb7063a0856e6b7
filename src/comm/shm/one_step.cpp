// The one-step threshold's choice: Note [Measured one-step threshold] in one_step.h.

#include "one_step.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>

namespace meshtrain {
namespace comm {
namespace shm_backend {

std::vector<int64_t> one_step_candidates(int64_t buffer_bytes) {
  std::vector<int64_t> sizes;
  for (int64_t s = 4 << 10; s <= std::min<int64_t>(buffer_bytes, 256 << 10); s *= 2) sizes.push_back(s);
  return sizes;
}

int64_t choose_one_step_bytes(const std::vector<OneStepTiming>& timings) {
  int64_t chosen = 0;
  double least = 0;
  for (const OneStepTiming& threshold : timings) {
    double cost = 0;
    for (const OneStepTiming& t : timings) {
      const double used = t.bytes <= threshold.bytes ? t.one_step_us : t.chunked_us;
      cost += used / std::max(1e-9, std::min(t.one_step_us, t.chunked_us));
    }
    if (chosen == 0 || cost < least) {
      chosen = threshold.bytes;
      least = cost;
    }
  }
  return chosen;
}

std::string format_timings(const std::vector<OneStepTiming>& timings) {
  std::ostringstream out;
  for (const OneStepTiming& t : timings) {
    char field[96];
    std::snprintf(field, sizeof field, "%s%lld %.3f %.3f", out.tellp() > 0 ? " " : "",
                  static_cast<long long>(t.bytes), t.one_step_us, t.chunked_us);
    out << field;
  }
  return out.str();
}

bool parse_timings(const std::string& line, const std::vector<int64_t>& sizes, std::vector<OneStepTiming>& out) {
  std::istringstream in(line);
  std::vector<OneStepTiming> timings(sizes.size());
  const auto plausible = [](double us) { return std::isfinite(us) && us > 0 && us < 1e7; };
  for (size_t i = 0; i < sizes.size(); ++i) {
    OneStepTiming& t = timings[i];
    if (!(in >> t.bytes >> t.one_step_us >> t.chunked_us) || t.bytes != sizes[i] || !plausible(t.one_step_us) ||
        !plausible(t.chunked_us)) {
      return false;
    }
  }
  std::string extra;
  if (sizes.empty() || in >> extra) return false;
  out = timings;
  return true;
}

std::string describe_one_step(int64_t chosen, int ranks, const std::string& why) {
  std::ostringstream out;
  out << "shm one step up to " << (chosen >> 10) << " KiB on " << ranks << " rank" << (ranks == 1 ? "" : "s") << " ("
      << why << ")";
  return out.str();
}

std::string describe_one_step(int64_t chosen, int ranks, const std::vector<OneStepTiming>& timings, bool cached) {
  std::ostringstream why;
  why << "all_reduce, us one step / chunked:";
  for (const OneStepTiming& t : timings) {
    char field[64];
    std::snprintf(field, sizeof field, " %lldK %.1f/%.1f", static_cast<long long>(t.bytes >> 10), t.one_step_us,
                  t.chunked_us);
    why << field;
  }
  return describe_one_step(chosen, ranks, why.str()) + (cached ? " (cached)" : "");
}

}  // namespace shm_backend
}  // namespace comm
}  // namespace meshtrain
