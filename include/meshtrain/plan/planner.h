#pragma once
// meshtrain plan: which of the article's three scenarios a model is in on a
// cluster, every layout's per-device estimate, and the layout to use.
//
//   scenario 1  the model, its activations and its optimizer state fit on one
//               device (plain DDP fits): data parallel (DDP, ZeRO)
//   scenario 2  they do not, but the largest single tensor with its gradient
//               and optimizer state does: pipeline and/or tensor parallel (or ZeRO)
//   scenario 3  even that tensor does not fit: tensor parallel (split the tensor)
//
// "Fits" always means within usable_memory(): device memory minus the margin.

#include <iosfwd>
#include <optional>
#include <string>
#include <vector>

#include "meshtrain/plan/estimate.h"
#include "meshtrain/plan/input.h"

namespace meshtrain {
namespace plan {

struct Scenario {
  int number = 1;      // 1, 2 or 3
  std::string reason;  // one sentence, with the numbers that decided it
};

struct Recommendation {
  Estimate estimate;
  std::string reason;
  // The busiest device's activations in this layout with each attention
  // (estimate_layout with input.attention set), to show what flash would save.
  int64_t eager_activation_bytes = 0;
  int64_t flash_activation_bytes = 0;
};

// The smallest cluster (whole nodes of the same devices) on which some layout fits.
struct ClusterSize {
  int devices = 0;
  int nodes = 0;
  Estimate estimate;  // the layout it would use
};

struct Plan {
  PlanInput input;
  Scenario scenario;
  std::vector<Estimate> candidates;              // every layout, in (tp, pp, zero) order
  std::optional<Recommendation> recommendation;  // absent when nothing fits
  std::optional<ClusterSize> smallest_cluster;   // searched only when nothing fits
  std::string no_fit_message;                    // non-empty when nothing fits
  // The line that runs the recommendation with meshtrain's trainer
  // (train_command, command.h); absent without a recommendation or when
  // command_problem() names why (said in command_note).
  std::optional<std::string> command;
  std::string command_note;        // how to run it (nodes, data), or why there is no command
  std::vector<std::string> notes;  // what the estimate leaves out
};

// Largest cluster the "smallest cluster" search tries.
constexpr int kMaxSearchDevices = 65536;

Scenario classify_scenario(const PlanInput& input);

// "dp=8 pp=1 tp=1 ZeRO-0 (DDP)".
std::string describe_layout(const Layout& layout);

// Orders fitting layouts, best first: the shortest predicted step (time.h;
// at one global batch, the highest throughput), then the lower ZeRO stage,
// then less memory.
bool better_layout(const Estimate& a, const Estimate& b);

// The best fitting layout of input's cluster, if any.
std::optional<Recommendation> recommend(const PlanInput& input, const std::vector<Estimate>& candidates);

// The least activation memory the busiest device can have on any cluster:
// the best tp and pp, with as few micro-batches in flight as the global batch
// allows. Above usable_memory, no cluster size fits and the search is skipped.
int64_t activation_floor_bytes(const PlanInput& input);

// Tries clusters of k * devices_per_node devices, k = 1, 2, ... up to
// kMaxSearchDevices; the first on which a layout fits.
std::optional<ClusterSize> find_smallest_cluster(const PlanInput& input);

// Everything above for one input.
Plan make_plan(const PlanInput& input);

// The plan as a table with the scenario and the recommendation, or as one JSON object.
std::string format_plan_text(const Plan& plan);
std::string format_plan_json(const Plan& plan);

// `meshtrain plan` flags and what they mean.
std::string plan_usage();

// `meshtrain plan ARGS`: prints the plan (text, or JSON with --json) to `out`.
// Returns 0 when a layout fits, 2 on bad input or when nothing fits (the
// message, and the smallest cluster that would fit, are printed to `out`;
// with --json as {"error": ...} or inside the plan object).
int run_plan(const std::vector<std::string>& args, std::ostream& out);

}  // namespace plan
}  // namespace meshtrain
