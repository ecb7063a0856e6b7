#include "app/trainer/elastic.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdlib>
#include <set>

#include "meshtrain/comm.h"
#include "app/launch/elastic.h"
#include "meshtrain/plan.h"
#include "app/trainer/memory_check.h"
#include "meshtrain/util.h"
#include "util/flags.h"
#include "util/strings.h"

namespace meshtrain {
namespace train {

namespace {

// "dp2xpp2" -> the degrees (1 where left out).
WorldLayout parse_degrees(const std::string& entry, const std::string& text) {
  WorldLayout l;
  for (const std::string& token : split(text, 'x')) {
    const size_t digits = token.find_first_of("0123456789");
    const std::string axis = token.substr(0, digits);
    MESHTRAIN_CHECK(digits != std::string::npos && digits > 0, "--elastic-layouts: '", entry, "' has '", token,
                    "'; each degree is dpN, ppN, tpN or zeroN, joined by x (e.g. 4:dp2xpp2)");
    const int v = flags::to_integer<int>("--elastic-layouts", token.substr(digits));
    int* field = axis == "dp" ? &l.dp : axis == "pp" ? &l.pp : axis == "tp" ? &l.tp : axis == "zero" ? &l.zero : nullptr;
    MESHTRAIN_CHECK(field, "--elastic-layouts: '", entry, "' names the axis '", axis, "'; axes are dp, pp, tp, zero");
    MESHTRAIN_CHECK(axis == "zero" ? v >= 0 && v <= 3 : v >= 1, "--elastic-layouts: '", entry, "': ", token,
                    axis == "zero" ? " is not a ZeRO stage (0 to 3)" : " must be at least 1");
    *field = v;
  }
  return l;
}

// `parsed` with the layout `l`, the layout-specific choices of the flags dropped.
TrainConfig with_layout(TrainConfig c, const WorldLayout& l) {
  c.dp = l.dp;
  c.pp = l.pp;
  c.tp = l.tp;
  if (l.zero >= 0) c.zero = l.zero;
  c.microbatches = 0;
  c.micro_batch = 0;
  c.stage_boundaries.clear();
  if (c.pp == 1) c.virtual_stages = 1;
  c.sequence_parallel = c.sequence_parallel && c.tp > 1;
  return c;
}

// The planner's layouts for `world` ranks of `rank_memory` bytes that fit, best first.
std::vector<WorldLayout> planner_layouts(const TrainConfig& c, int world, int64_t rank_memory) {
  TrainConfig one_sample = c;
  one_sample.micro_batch = 1;  // the planner's divisibility test is then the global batch's
  plan::PlanInput in = planner_input(one_sample, world, rank_memory);
  std::vector<plan::Estimate> fits;
  for (const plan::Estimate& e : plan::make_plan(in).candidates) {
    if (e.fits) fits.push_back(e);
  }
  std::stable_sort(fits.begin(), fits.end(), plan::better_layout);
  std::vector<WorldLayout> layouts;
  for (const plan::Estimate& e : fits) layouts.push_back({world, e.layout.dp, e.layout.pp, e.layout.tp, e.layout.zero});
  return layouts;
}

}  // namespace

std::vector<WorldLayout> parse_elastic_layouts(const std::string& spec) {
  std::vector<WorldLayout> layouts;
  if (spec.empty()) return layouts;
  std::set<int> worlds;
  for (const std::string& entry : split(spec, ',')) {
    const auto colon = entry.find(':');
    MESHTRAIN_CHECK(colon != std::string::npos, "--elastic-layouts: '", entry,
                    "' needs WORLD:LAYOUT, e.g. 4:dp2xpp2 (a world of 4 ranks as dp 2 x pp 2)");
    WorldLayout l = parse_degrees(entry, entry.substr(colon + 1));
    l.world = flags::to_integer<int>("--elastic-layouts", entry.substr(0, colon));
    MESHTRAIN_CHECK(l.dp * l.pp * l.tp == l.world, "--elastic-layouts: '", entry, "' is dp ", l.dp, " x pp ", l.pp,
                    " x tp ", l.tp, " = ", l.dp * l.pp * l.tp, " ranks, not ", l.world);
    MESHTRAIN_CHECK(worlds.insert(l.world).second, "--elastic-layouts: the world size ", l.world, " is given twice");
    layouts.push_back(l);
  }
  return layouts;
}

LayoutChoice resolve_for_world(const TrainConfig& parsed, int world, bool elastic, int64_t rank_memory) {
  for (const WorldLayout& l : parse_elastic_layouts(parsed.elastic_layouts)) {
    if (l.world == world) return {resolve(with_layout(parsed, l), world), "--elastic-layouts"};
  }
  std::string flags_problem;
  try {
    return {resolve(parsed, world), "the flags"};
  } catch (const ConfigError& e) {
    if (!elastic) throw;
    flags_problem = e.what();
  }
  for (const WorldLayout& l : planner_layouts(parsed, world, rank_memory)) {
    try {
      return {resolve(with_layout(parsed, l), world), "the planner"};
    } catch (const ConfigError&) {  // a layout the trainer cannot run with these flags: the next best
    }
  }
  throw ConfigError(str_cat("meshtrain: no layout for this round's world of ", world, " ranks: the flags' layout does ",
                            "not fit it (", flags_problem, ") and no layout the planner estimates does either; give ",
                            "one with --elastic-layouts ", world, ":dp", world));
}

bool regroup_requested(comm::Communicator& world) {
  if (!std::getenv(launch::kRegroupKeyVariable)) return false;
  at::Tensor waiting = at::zeros({1}, at::kDouble);
  if (world.rank() == 0 && launch::node_waiting_to_join()) waiting.fill_(1);
  world.all_reduce(waiting);
  return waiting.item<double>() > 0;
}

}  // namespace train
}  // namespace meshtrain
