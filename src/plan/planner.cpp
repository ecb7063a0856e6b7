#include "meshtrain/plan.h"

#include <algorithm>
#include <climits>
#include <cmath>

#include "plan/command.h"
#include "plan/units.h"
#include "meshtrain/util.h"

namespace meshtrain {
namespace plan {

namespace {

// "16 GB", "85.9 GB": device sizes without needless decimals.
std::string device_size(int64_t bytes) {
  const bool whole = bytes % 1000000000 == 0;
  return gigabytes(static_cast<double>(bytes), whole ? 0 : 1) + " GB";
}

// "the 14.4 GB usable of a 16 GB device".
std::string usable_of(const PlanInput& in) {
  const std::string device = device_size(in.device_memory);
  return "the " + gigabytes(usable_memory(in)) + " GB usable of " + a_or_an(device) + " " + device + " device";
}

// "fp32 Adam", "bf16-mixed SGD with momentum".
std::string training_name(const PlanInput& in) {
  const std::string opt =
      in.optimizer == OptimizerKind::kAdam ? "Adam" : (in.momentum > 0 ? "SGD with momentum" : "SGD");
  return precision_name(in.precision) + " " + opt;
}

std::string tensor_name(const TensorShape& t) {
  return "the " + with_commas(t.rows) + " x " + with_commas(t.cols) + " " + t.name;
}

std::vector<Estimate> estimate_all(const PlanInput& in) {
  std::vector<Estimate> estimates;
  for (const Layout& layout : candidate_layouts(in)) estimates.push_back(estimate_layout(in, layout));
  return estimates;
}

// What --activation-checkpointing would change when nothing fits: this
// cluster, or the smallest one, with only layer inputs kept.
std::string checkpointing_hint(const PlanInput& in) {
  PlanInput checkpointed = in;
  checkpointed.activation_checkpointing = true;
  if (recommend(checkpointed, estimate_all(checkpointed)))
    return str_cat(" With --activation-checkpointing blocks it fits on these ", in.devices, " devices.");
  if (const auto cluster = find_smallest_cluster(checkpointed))
    return str_cat(" With --activation-checkpointing blocks the smallest cluster that fits has ", cluster->devices,
                   " devices: ", describe_layout(cluster->estimate.layout), " at ",
                   gigabytes(cluster->estimate.memory.total()), " GB per device.");
  return "";
}

// Why nothing fits this cluster, and what would.
std::string no_fit_message(const Plan& plan) {
  const PlanInput& in = plan.input;
  std::string msg;
  if (plan.candidates.empty()) {
    msg = str_cat("no layout of ", in.devices, " devices suits this model and batch: dp must divide the ",
                  global_batch_of(in) / in.micro_batch, " micro-batches of a step (global batch / micro-batch)",
                  in.shape ? str_cat(", tp must divide --heads ", in.shape->heads, ", --kv-heads ",
                                     kv_heads_of(*in.shape), ", --ffn-hidden ", ffn_hidden_of(*in.shape),
                                     " and the vocabulary's ", embedding_rows(*in.shape),
                                     " rows, pp at most --layers + 2 = ", in.shape->layers + 2)
                           : std::string(", and pp = tp = 1 without the model's shape"),
                  ".");
  } else {
    const Estimate& least =
        *std::min_element(plan.candidates.begin(), plan.candidates.end(),
                          [](const Estimate& a, const Estimate& b) { return a.memory.total() < b.memory.total(); });
    msg = str_cat("nothing fits: the layout needing the least memory, ", describe_layout(least.layout), ", needs ",
                  gigabytes(least.memory.total()), " GB per device, more than ", usable_of(in), ".");
  }
  if (plan.smallest_cluster) {
    const ClusterSize& c = *plan.smallest_cluster;
    msg += str_cat(" The smallest cluster that fits has ", c.devices, " devices (", c.nodes,
                   c.nodes == 1 ? " node" : " nodes", " of ", devices_per_node_of(in),
                   "): ", describe_layout(c.estimate.layout), " at ", gigabytes(c.estimate.memory.total()),
                   " GB per device", c.estimate.tp_in_node ? "." : " (tp across nodes).");
  } else {
    const int64_t floor = activation_floor_bytes(in);
    const std::string why =
        static_cast<double>(floor) > usable_memory(in)
            ? str_cat(": the activations alone need at least ", gigabytes(static_cast<double>(floor)),
                      " GB on the busiest device, whatever the layout")
            : "";
    msg += str_cat(" No cluster of up to ", with_commas(kMaxSearchDevices), " devices (in nodes of ",
                   devices_per_node_of(in), ") fits", why, "; try a smaller --micro-batch, ",
                   "--activation-checkpointing blocks, or devices with more memory.");
  }
  if (!in.activation_checkpointing && in.shape) msg += checkpointing_hint(in);
  return msg;
}

std::vector<std::string> notes_for(const PlanInput& in) {
  std::vector<std::string> notes;
  if (!in.shape)
    notes.push_back(
        "only the parameter count is known: activations, pipeline and tensor parallel layouts and "
        "ZeRO-3's gathered units are not estimated; give the model's shape for them");
  if (in.shape && in.shape->kind != ModelKind::kLlama && in.precision == Precision::kFp32)
    notes.push_back("fp32 activations are estimated as twice Megatron's 16-bit figures (an upper bound)");
  notes.push_back(
      "step times add compute (at --device-tflops), the pipeline bubble, tp and pp communication (alpha-beta per "
      "link class, on the critical path) and the dp reduction the backward does not hide (docs/plan.md, Step time); "
      "not modelled: the vocabulary-parallel all-reduces, the optimizer step, memory-bound kernels");
  if (!in.shape)
    notes.push_back("without the model's shape the tokens per step are unknown: compute time is not estimated");
  notes.push_back(
      "memory excludes the framework's own use (CUDA context, allocator fragmentation): the margin covers it");
  return notes;
}

// The busiest device's activations in the recommended layout under each
// attention: what flash attention would save at this sequence length.
void compare_attention(const PlanInput& in, Recommendation& r) {
  if (!in.shape) return;
  PlanInput eager = in, flash = in;
  eager.attention = Attention::kEager;
  flash.attention = Attention::kFlash;
  r.eager_activation_bytes = estimate_layout(eager, r.estimate.layout).memory.activations;
  r.flash_activation_bytes = estimate_layout(flash, r.estimate.layout).memory.activations;
}

// What running the printed command needs beyond it: each node's rank and
// node 0's address, and the data. (The command passes --attention, so the
// run uses the kernel whose memory was planned.)
std::string command_note(const PlanInput& in) {
  const int nodes = in.devices / devices_per_node_of(in);
  std::string note = nodes == 1 ? "" : str_cat("run it on each of the ", nodes, " nodes with NODE_RANK 0 to ",
                                               nodes - 1, ", MASTER_ADDR node 0's address and the same ",
                                               "MESHTRAIN_RDZV_TOKEN (docs/comm.md); ");
  note += "without --data it trains the built-in arithmetic task: add --data FILE (text or token shards) and "
          "--steps N";
  return note;
}

void add_command(Plan& plan) {
  const std::string problem = command_problem(plan.input);
  if (!problem.empty()) {
    plan.command_note = "no command: " + problem;
    return;
  }
  plan.command = train_command(plan.input, plan.recommendation->estimate);
  plan.command_note = command_note(plan.input);
}

}  // namespace

std::string describe_layout(const Layout& l) {
  static const char* kZeroNames[] = {"DDP", "optimizer state sharded", "+ gradients sharded", "fully sharded"};
  return str_cat("dp=", l.dp, " pp=", l.pp, " tp=", l.tp, l.cp > 1 ? str_cat(" cp=", l.cp) : "",
                 l.ep > 1 ? str_cat(" ep=", l.ep) : "", " ZeRO-", l.zero,
                 l.replicas() > 1 ? str_cat(" (", kZeroNames[l.zero], ")") : "");
}

Scenario classify_scenario(const PlanInput& in) {
  const MemoryBytes one = stage_memory(in, Layout{1, 1, 1, 0}, 0, 1);  // the whole model on one device
  const int64_t state = one.parameters + one.gradients + one.optimizer;
  const double usable = usable_memory(in);
  if (state + one.activations <= usable) {
    const std::string activations = in.shape ? str_cat(" and ", gigabytes(one.activations), " GB of activations")
                                           : std::string(" (activations unknown without the model's shape)");
    return {1, str_cat("the whole model (", with_commas(in.params), " parameters) needs ", gigabytes(state),
                       " GB of state with ", training_name(in), activations, " per device with DDP: it fits ",
                       usable_of(in), ": scenario 1, data parallel (DDP or ZeRO)")};
  }
  const std::string too_big = str_cat("the model needs ", gigabytes(state + one.activations),
                                      " GB per device with DDP (state and activations), more than ", usable_of(in));
  if (!in.shape) {
    return {2, too_big +
                   ": scenario 2 (without the model's shape the largest tensor is unknown: give the shape to rule "
                   "out scenario 3)"};
  }
  const TensorShape largest = largest_tensor(*in.shape);
  const int per_param = state_bytes_per_param(in.precision, in.optimizer, in.momentum > 0).total();
  const double tensor_bytes = static_cast<double>(largest.numel()) * per_param;
  if (tensor_bytes > usable) {
    return {3, str_cat("the largest single tensor, ", tensor_name(largest), ", needs ", gigabytes(tensor_bytes),
                       " GB with ", training_name(in), " (", per_param, " bytes per parameter): it does not fit ",
                       usable_of(in), ": scenario 3, tensor parallel")};
  }
  return {2, str_cat(too_big, ", but its largest tensor, ", tensor_name(largest), ", needs only ",
                     gigabytes(tensor_bytes), " GB with ", training_name(in),
                     ": scenario 2, pipeline and/or tensor parallel, or ZeRO to shard the state")};
}

bool better_layout(const Estimate& a, const Estimate& b) {
  if (a.step_seconds() != b.step_seconds()) return a.step_seconds() < b.step_seconds();
  if (a.layout.zero != b.layout.zero) return a.layout.zero < b.layout.zero;  // DDP overlaps more than ZeRO-1
  return a.memory.total() < b.memory.total();
}

std::optional<Recommendation> recommend(const PlanInput& in, const std::vector<Estimate>& candidates) {
  const Estimate* best = nullptr;
  int fitting = 0;
  for (const Estimate& e : candidates) {
    if (!e.fits) continue;
    ++fitting;
    if (!best || better_layout(e, *best)) best = &e;
  }
  if (!best) return std::nullopt;
  const Layout& l = best->layout;
  std::string reason = str_cat(
      describe_layout(l), ": needs ", gigabytes(best->memory.total()), " GB of ", usable_of(in), "; of the ", fitting,
      fitting == 1 ? " layout that fits" : " layouts that fit", ", it has the shortest predicted step, ",
      seconds_text(best->step_seconds()), " s (compute ", seconds_text(best->compute_seconds), ", pipeline bubble ",
      seconds_text(best->bubble_seconds), ", tp ", seconds_text(best->seconds.tp), ", pp ",
      seconds_text(best->seconds.pp), l.cp > 1 ? str_cat(", cp ", seconds_text(best->seconds.cp)) : "",
      l.ep > 1 ? str_cat(", ep ", seconds_text(best->seconds.ep)) : "", ", dp exposed ",
      seconds_text(best->dp_exposed_seconds), " of ", seconds_text(best->seconds.dp), ")");
  if (in.shape)
    reason += str_cat(": ", with_commas(std::llround(best->tokens_per_second())), " tokens/s, ",
                      tflops_text(best->flops_per_device(in.devices)), " model TFLOP/s per device");
  if (l.tp > 1 && best->tp_in_node)
    reason += str_cat("; tp=", l.tp, " stays inside a node of ", devices_per_node_of(in));
  if (!best->tp_in_node) reason += "; tp crosses the slower inter-node link";
  return Recommendation{*best, reason};
}

int64_t activation_floor_bytes(const PlanInput& in) {
  if (!in.shape) return 0;
  int64_t floor = INT64_MAX;
  for (int tp = 1; tp <= in.shape->heads; ++tp) {
    if (!layout_problem(*in.shape, Layout{1, 1, tp, 0}).empty()) continue;
    for (int pp = 1; pp <= num_pieces(*in.shape); ++pp) {
      // With the default global batch (micro-batch x devices) a step has
      // devices / dp = pp * tp micro-batches; a given batch allows as few as 1.
      const int64_t microbatches = in.global_batch == 0 ? static_cast<int64_t>(pp) * tp : 1;
      int64_t busiest = 0;
      for (int stage = 0; stage < pp && busiest < floor; ++stage)
        busiest = std::max(busiest, stage_activation_bytes(in, Layout{1, pp, tp, 0}, stage, microbatches));
      floor = std::min(floor, busiest);
    }
  }
  return floor;
}

std::optional<ClusterSize> find_smallest_cluster(const PlanInput& in) {
  // More devices shrink the model state per device, not the activations below this.
  if (static_cast<double>(activation_floor_bytes(in)) > usable_memory(in)) return std::nullopt;
  const int per_node = devices_per_node_of(in);
  // No layout exists beyond (micro-batches) x (max tp) x (max pp) devices.
  const int64_t max_model_splits = in.shape ? in.shape->heads * num_pieces(*in.shape) : 1;
  // Every parameter's state is held at least once across the cluster, so
  // fewer devices than state / usable memory cannot fit.
  const double state =
      static_cast<double>(in.params) * state_bytes_per_param(in.precision, in.optimizer, in.momentum > 0).total();
  const int64_t least_nodes = static_cast<int64_t>(std::ceil(state / usable_memory(in) / per_node));
  for (int64_t devices = std::max<int64_t>(1, least_nodes) * per_node; devices <= kMaxSearchDevices;
       devices += per_node) {
    PlanInput cluster = in;
    cluster.devices = static_cast<int>(devices);
    cluster.devices_per_node = per_node;
    if (in.global_batch > 0 && devices > in.global_batch / in.micro_batch * max_model_splits) break;
    if (auto best = recommend(cluster, estimate_all(cluster)))
      return ClusterSize{cluster.devices, cluster.devices / per_node, best->estimate};
  }
  return std::nullopt;
}

Plan make_plan(const PlanInput& in) {
  check_plan_input(in);
  Plan plan;
  plan.input = in;
  plan.scenario = classify_scenario(in);
  plan.candidates = estimate_all(in);
  plan.recommendation = recommend(in, plan.candidates);
  if (plan.recommendation && plan.scenario.number == 3 && plan.recommendation->estimate.layout.tp == 1) {
    plan.recommendation->reason +=
        "; ZeRO shards the largest tensor's state over the dp ranks instead of splitting "
        "it with tp";
  }
  if (plan.recommendation) {
    compare_attention(in, *plan.recommendation);
    add_command(plan);
  } else {
    plan.smallest_cluster = find_smallest_cluster(in);
    plan.no_fit_message = no_fit_message(plan);
  }
  plan.notes = notes_for(in);
  return plan;
}

}  // namespace plan
}  // namespace meshtrain
