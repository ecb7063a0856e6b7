#pragma once
// What `meshtrain plan` is asked: a model (the shape of one of meshtrain's
// decoders, or a bare parameter count), how it is trained (precision, optimizer, batch) and the
// cluster (devices, memory, nodes, links). Parsed from command-line flags,
// checked as a whole: every error names the flag, the value and the fix.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "meshtrain/plan/model.h"

namespace meshtrain {
namespace plan {

// The pipeline schedule the trainer runs (--schedule): the planner models
// 1F1B and Megatron's interleaved 1F1B with V chunks per rank.
enum class Schedule { k1F1B, kInterleaved };

struct PlanInput {
  // The model: a decoder's shape, or only a parameter count (then the planner
  // knows no tensor sizes: no activations, no pipeline or tensor parallel
  // layouts, no command to run).
  std::optional<DecoderShape> shape;
  int64_t params = 0;  // --params; with a shape, parameter_count(*shape)
  Attention attention = Attention::kEager;  // how attention keeps its activations
  // Context parallelism the planner may use, up to this many ranks per
  // sequence (--max-cp; 1: none). Layouts with cp > 1 run ring attention,
  // whose activations are flash attention's on seq_len / cp positions.
  int max_cp = 1;
  // Expert parallelism the planner may use for a mixture of experts, up to
  // this many ranks per expert group (--max-ep; 1: none).
  int max_ep = 1;

  // Training.
  int64_t micro_batch = 1;
  int64_t global_batch = 0;  // 0: micro_batch * devices (see global_batch_of)
  Precision precision = Precision::kFp32;
  OptimizerKind optimizer = OptimizerKind::kAdam;
  double momentum = 0;  // SGD's momentum factor, as the trainer's --momentum; > 0 keeps a buffer
  bool activation_checkpointing = false;
  Schedule schedule = Schedule::k1F1B;
  int virtual_stages = 2;  // chunks per rank under the interleaved schedule
  // The data axis reduces gradients during backward (meshtrain's DDP; the
  // trainer's --no-overlap turns it off). See Note [What the step time overlaps].
  bool grad_overlap = true;

  // The cluster. Bandwidths are per device and direction.
  int devices = 0;
  int64_t device_memory = 0;            // bytes
  int devices_per_node = 0;             // 0: all devices in one node
  double intra_node_bandwidth = 300e9;  // NVLink-class, bytes/s
  double inter_node_bandwidth = 25e9;   // one 200 Gb/s NIC per device, bytes/s
  double intra_node_latency = 3e-6;     // seconds per message (alpha), NVLink-class
  double inter_node_latency = 8e-6;     // seconds per message, InfiniBand-class
  double memory_margin = 0.10;          // keep this fraction of each device free
  double device_flops = 100e12;         // achieved (not peak) FLOP/s per device
  // Megatron-LM's scatter/gather of pipeline messages (Narayanan et al. 2021,
  // §4.1): each tp rank sends 1/tp of an activation across nodes and the
  // receivers all-gather it. meshtrain sends it whole: false; no flag, for
  // modelling Megatron's runs (tests/unit/test_plan_time.cpp).
  bool p2p_scatter_gather = false;

  bool json = false;
};

// Parses `meshtrain plan` flags ("--name value" or "--name=value"); throws
// ConfigError on unknown flags, bad values or an inconsistent whole.
PlanInput parse_plan_args(const std::vector<std::string>& args);

// Throws ConfigError unless the input is complete and consistent (a model,
// devices and memory given, devices a multiple of devices_per_node, ...).
void check_plan_input(const PlanInput& input);

// The resolved defaults.
int64_t global_batch_of(const PlanInput& input);
int devices_per_node_of(const PlanInput& input);
// Device memory the planner may fill: device_memory * (1 - memory_margin).
double usable_memory(const PlanInput& input);

std::string precision_name(Precision precision);
std::string optimizer_name(OptimizerKind optimizer);
std::string attention_name(Attention attention);  // "eager", "flash"
std::string schedule_name(Schedule schedule);     // "1f1b", "interleaved"

}  // namespace plan
}  // namespace meshtrain
