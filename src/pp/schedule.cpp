#include "meshtrain/pp.h"

#include <algorithm>
#include <climits>
#include <deque>
#include <map>
#include <set>
#include <tuple>

#include "meshtrain/util.h"

namespace meshtrain {
namespace pp {

std::string to_string(const Action& a) {
  const std::string id = std::to_string(a.stage) + (a.kind == ActionKind::kForward || a.kind == ActionKind::kSendActivation ||
                                                            a.kind == ActionKind::kRecvActivation
                                                        ? "F"
                                                        : "B") +
                         std::to_string(a.microbatch);
  switch (a.kind) {
    case ActionKind::kForward:
    case ActionKind::kBackward: return id;
    case ActionKind::kSendActivation:
    case ActionKind::kSendGrad: return "send " + id + ">" + std::to_string(a.peer);
    case ActionKind::kRecvActivation:
    case ActionKind::kRecvGrad: return "recv " + id + "<" + std::to_string(a.peer);
  }
  return "?";
}

std::string to_string(const std::vector<Action>& actions) {
  std::string out;
  for (const auto& a : actions) out += (out.empty() ? "" : " ") + to_string(a);
  return out;
}

void validate(const ScheduleSpec& s) {
  MESHTRAIN_CHECK(s.kind == "naive" || s.kind == "gpipe" || s.kind == "1f1b" || s.kind == "interleaved",
                  "--schedule '", s.kind, "' is unknown; use naive, gpipe, 1f1b or interleaved");
  MESHTRAIN_CHECK(s.ranks >= 1 && s.microbatches >= 1 && s.virtual_stages >= 1, "pipeline: ranks (", s.ranks,
                  "), micro-batches (", s.microbatches, ") and virtual stages (", s.virtual_stages, ") must be positive");
  MESHTRAIN_CHECK(s.kind == "interleaved" || s.virtual_stages == 1, "--virtual-stages ", s.virtual_stages,
                  " needs --schedule interleaved");
  if (s.kind == "interleaved") {
    MESHTRAIN_CHECK(s.microbatches % s.ranks == 0, "the interleaved schedule needs --microbatches divisible by --pp: ",
                    s.microbatches, " is not a multiple of ", s.ranks, "; use ", (s.microbatches / s.ranks + 1) * s.ranks);
  }
}

namespace {

struct Compute {
  bool forward;
  int stage;
  int mb;
};

// Compute order of one rank (no communication yet).
std::vector<Compute> compute_order(const ScheduleSpec& s, int r) {
  const int p = s.ranks, m = s.microbatches, V = s.virtual_stages;
  std::vector<Compute> out;
  if (s.kind == "naive") {
    for (int mb = 0; mb < m; ++mb) {
      out.push_back({true, r, mb});
      out.push_back({false, r, mb});
    }
  } else if (s.kind == "gpipe") {
    for (int mb = 0; mb < m; ++mb) out.push_back({true, r, mb});
    for (int mb = 0; mb < m; ++mb) out.push_back({false, r, mb});
  } else if (s.kind == "1f1b") {
    const int warmup = std::min(p - r - 1, m);
    int f = 0, b = 0;
    for (; f < warmup; ++f) out.push_back({true, r, f});
    while (f < m) {
      out.push_back({true, r, f++});
      out.push_back({false, r, b++});
    }
    while (b < m) out.push_back({false, r, b++});
  } else {  // interleaved (Megatron): forward unit k -> (chunk, micro-batch)
    const int total = m * V;
    auto fwd = [&](int k) {
      const int chunk = (k / p) % V;
      const int mb = (k / (p * V)) * p + k % p;
      return Compute{true, chunk * p + r, mb};
    };
    auto bwd = [&](int k) {
      const int chunk = V - 1 - (k / p) % V;
      const int mb = (k / (p * V)) * p + k % p;
      return Compute{false, chunk * p + r, mb};
    };
    const int warmup = std::min(total, (p - r - 1) * 2 + (V - 1) * p);
    int f = 0, b = 0;
    for (; f < warmup; ++f) out.push_back(fwd(f));
    while (f < total) {
      out.push_back(fwd(f++));
      out.push_back(bwd(b++));
    }
    while (b < total) out.push_back(bwd(b++));
  }
  return out;
}

}  // namespace

std::vector<std::vector<Action>> make_schedule(const ScheduleSpec& s) {
  validate(s);
  const int p = s.ranks, S = s.stages();
  std::vector<std::vector<Action>> out(p);
  for (int r = 0; r < p; ++r) {
    for (const Compute& c : compute_order(s, r)) {
      if (c.forward) {
        if (c.stage > 0) out[r].push_back({ActionKind::kRecvActivation, c.stage - 1, c.mb, rank_of_stage(c.stage - 1, p)});
        out[r].push_back({ActionKind::kForward, c.stage, c.mb});
        if (c.stage < S - 1) out[r].push_back({ActionKind::kSendActivation, c.stage, c.mb, rank_of_stage(c.stage + 1, p)});
      } else {
        if (c.stage < S - 1) out[r].push_back({ActionKind::kRecvGrad, c.stage + 1, c.mb, rank_of_stage(c.stage + 1, p)});
        out[r].push_back({ActionKind::kBackward, c.stage, c.mb});
        if (c.stage > 0) out[r].push_back({ActionKind::kSendGrad, c.stage, c.mb, rank_of_stage(c.stage - 1, p)});
      }
    }
  }
  return out;
}

bool forwards_before_backwards(const ScheduleSpec& s) {
  for (const std::vector<Action>& actions : make_schedule(s)) {
    std::set<int> backward_seen;  // stages of this rank that ran a backward
    for (const Action& a : actions) {
      if (a.kind == ActionKind::kBackward) backward_seen.insert(a.stage);
      if (a.kind == ActionKind::kForward && backward_seen.count(a.stage)) return false;
    }
  }
  return true;
}

Replay replay(const ScheduleSpec& s, const std::vector<std::vector<Action>>& sched) {
  Replay result;
  const int p = s.ranks;
  result.max_in_flight.assign(p, 0);
  // Messages sent and not yet received: (kind of receive, stage, mb, from, to).
  std::multiset<std::tuple<int, int, int, int, int>> mailbox;
  std::vector<size_t> pc(p, 0);
  std::vector<std::set<std::pair<int, int>>> forwarded(p);  // (stage, mb) forwarded, not yet backwarded
  std::vector<std::set<std::pair<int, int>>> done_f(p), done_b(p);
  for (bool progress = true; progress;) {
    progress = false;
    for (int r = 0; r < p; ++r) {
      while (pc[r] < sched[r].size()) {
        const Action& a = sched[r][pc[r]];
        if (a.kind == ActionKind::kRecvActivation || a.kind == ActionKind::kRecvGrad) {
          auto it = mailbox.find({static_cast<int>(a.kind), a.stage, a.microbatch, a.peer, r});
          if (it == mailbox.end()) break;  // blocks until the peer sent it
          mailbox.erase(it);
        } else if (a.kind == ActionKind::kSendActivation) {
          mailbox.insert({static_cast<int>(ActionKind::kRecvActivation), a.stage, a.microbatch, r, a.peer});
        } else if (a.kind == ActionKind::kSendGrad) {
          mailbox.insert({static_cast<int>(ActionKind::kRecvGrad), a.stage, a.microbatch, r, a.peer});
        } else if (a.kind == ActionKind::kForward) {
          if (!done_f[r].insert({a.stage, a.microbatch}).second) {
            result.problem = "rank " + std::to_string(r) + " runs " + to_string(a) + " twice";
            return result;
          }
          forwarded[r].insert({a.stage, a.microbatch});
          result.max_in_flight[r] = std::max(result.max_in_flight[r], static_cast<int>(forwarded[r].size()));
        } else {  // backward
          if (!forwarded[r].count({a.stage, a.microbatch})) {
            result.problem = "rank " + std::to_string(r) + " runs " + to_string(a) + " before its forward";
            return result;
          }
          forwarded[r].erase({a.stage, a.microbatch});
          done_b[r].insert({a.stage, a.microbatch});
        }
        ++pc[r];
        progress = true;
      }
    }
  }
  for (int r = 0; r < p; ++r) {
    if (pc[r] < sched[r].size()) {
      result.problem = "deadlock: rank " + std::to_string(r) + " waits at " + to_string(sched[r][pc[r]]);
      return result;
    }
  }
  if (!mailbox.empty()) {
    result.problem = "a message was sent but never received";
    return result;
  }
  for (int r = 0; r < p; ++r) {
    const size_t expected = static_cast<size_t>(s.microbatches) * s.virtual_stages;
    if (done_f[r].size() != expected || done_b[r].size() != expected) {
      result.problem = "rank " + std::to_string(r) + " does not run every forward and backward once";
      return result;
    }
  }
  result.completes = true;
  return result;
}

double ideal_bubble(const ScheduleSpec& s) {
  const double p = s.ranks, m = s.microbatches;
  if (s.kind == "naive") return (p - 1) / p;
  const double b = (p - 1) / (m + p - 1);
  return s.kind == "interleaved" ? b / s.virtual_stages : b;
}

std::vector<int64_t> partition_explicit(const std::vector<int64_t>& starts, int64_t pieces, int parts) {
  MESHTRAIN_CHECK(static_cast<int>(starts.size()) == parts - 1, "--stage-boundaries gives ", starts.size(),
                  " boundaries for ", parts, " stages (pp x virtual stages); give ", parts - 1,
                  ": the first piece of every stage but the first");
  std::vector<int64_t> bounds = {0};
  for (int64_t s : starts) {
    MESHTRAIN_CHECK(s > bounds.back() && s < pieces, "--stage-boundaries: ", s, " must be in (", bounds.back(), ", ",
                    pieces, "): boundaries increase and every stage holds at least one of the ", pieces, " pieces");
    bounds.push_back(s);
  }
  bounds.push_back(pieces);
  return bounds;
}

// The first j in [lo, hi] minimizing max(best_prev[j], total_i - prefix[j]),
// as a left-to-right scan would pick it. The first term does not decrease in j
// (more pieces never cost less) and the second does not increase (costs are
// not negative), so the maximum falls, then rises: binary searches find the
// crossing and the start of the plateau before it. O(log n), not O(n): a
// planner asks about models of 100,000 layers.
static std::pair<int, int64_t> best_last_cut(const std::vector<int64_t>& best_prev, const std::vector<int64_t>& prefix,
                                             int lo, int hi, int i) {
  auto left = [&](int j) { return best_prev[j]; };
  auto right = [&](int j) { return prefix[i] - prefix[j]; };
  int a = lo, b = hi + 1;  // the first j with left(j) >= right(j), or hi + 1
  while (a < b) {
    const int m = a + (b - a) / 2;
    if (left(m) >= right(m)) b = m; else a = m + 1;
  }
  const int crossing = a;
  if (crossing == lo) return {lo, left(lo)};
  const int64_t before = right(crossing - 1);
  if (crossing <= hi && left(crossing) < before) return {crossing, left(crossing)};
  a = lo, b = crossing - 1;  // the first j with right(j) == before (right does not increase)
  while (a < b) {
    const int m = a + (b - a) / 2;
    if (right(m) <= before) b = m; else a = m + 1;
  }
  return {a, before};
}

std::vector<int64_t> partition_balanced(const std::vector<int64_t>& costs, int parts) {
  const int n = static_cast<int>(costs.size());
  MESHTRAIN_CHECK(parts >= 1 && parts <= n, "cannot cut ", n, " pieces into ", parts,
                  " pipeline stages; use at most ", n, " stages (pp x virtual stages)");
  std::vector<int64_t> prefix(n + 1, 0);
  for (int i = 0; i < n; ++i) {
    MESHTRAIN_CHECK(costs[i] >= 0, "partition_balanced: piece ", i, " has a negative cost ", costs[i]);
    prefix[i + 1] = prefix[i] + costs[i];
  }
  // best[k][i]: least max cost of cutting the first i pieces into k parts;
  // cut[k][i]: where its last part starts.
  std::vector<std::vector<int64_t>> best(parts + 1, std::vector<int64_t>(n + 1, INT64_MAX));
  std::vector<std::vector<int>> cut(parts + 1, std::vector<int>(n + 1, 0));
  for (int i = 1; i <= n; ++i) best[1][i] = prefix[i];
  for (int k = 2; k <= parts; ++k) {
    for (int i = k; i <= n; ++i) std::tie(cut[k][i], best[k][i]) = best_last_cut(best[k - 1], prefix, k - 1, i - 1, i);
  }
  std::vector<int64_t> bounds(parts + 1);
  bounds[parts] = n;
  for (int k = parts, i = n; k > 0; --k) {
    i = cut[k][i];
    bounds[k - 1] = i;
  }
  return bounds;
}

}  // namespace pp
}  // namespace meshtrain
