#include "app/trainer/memory_check.h"

#include <algorithm>
#include <fstream>
#include <limits>
#include <sstream>

#include "meshtrain/models.h"
#include "meshtrain/plan.h"
#include "meshtrain/util.h"

namespace meshtrain {
namespace train {

namespace {

int64_t read_number(const std::string& path) {
  std::ifstream in(path);
  std::string text;
  if (!(in >> text) || text == "max") return std::numeric_limits<int64_t>::max();
  try {
    return std::stoll(text);
  } catch (const std::exception&) {
    return std::numeric_limits<int64_t>::max();
  }
}

std::string gib(int64_t bytes) {
  std::ostringstream out;
  out.precision(bytes >= (int64_t{10} << 30) ? 0 : 2);
  out << std::fixed << bytes / double(int64_t{1} << 30) << " GiB";
  return out.str();
}

// A line of /proc/meminfo ("MemTotal:") in bytes; unbounded when absent.
int64_t meminfo_bytes(const std::string& field) {
  std::ifstream meminfo("/proc/meminfo");
  std::string key, unit;
  int64_t kib = 0;
  while (meminfo >> key >> kib >> unit) {
    if (key == field) return kib * 1024;
  }
  return std::numeric_limits<int64_t>::max();
}

// What the planner recommends for `world` ranks sharing `available` bytes, said as flags.
std::string suggestion(const TrainConfig& c, int world, int local_ranks, int64_t available) {
  try {
    const plan::Plan p = plan::make_plan(planner_input(c, world, available / std::max(1, local_ranks)));
    if (p.recommendation) {
      const plan::Layout& l = p.recommendation->estimate.layout;
      return str_cat("the planner suggests --dp ", l.dp, " --pp ", l.pp, " --tp ", l.tp,
                     l.cp > 1 ? str_cat(" --cp ", l.cp) : "", l.ep > 1 ? str_cat(" --ep ", l.ep) : "", " --zero ", l.zero,
                     " (about ", gib(p.recommendation->estimate.memory.total()), " per rank)");
    }
    if (p.smallest_cluster) {
      return str_cat("no layout of ", world, world == 1 ? " rank" : " ranks", " fits; the planner's smallest fit is ",
                     p.smallest_cluster->devices, " ranks with ", gib(available / std::max(1, local_ranks)),
                     " each (meshtrain plan estimates every layout)");
    }
  } catch (const std::exception&) {  // the planner cannot model this configuration: no suggestion
  }
  return "try fewer ranks per machine, ZeRO-3 (--zero 3), activation checkpointing, or more machines "
         "(meshtrain plan estimates each layout)";
}

}  // namespace

plan::DecoderShape decoder_shape(const models::ModelConfig& m) {
  MESHTRAIN_CHECK(models::is_language_model(m), "the planner's shapes are the language models' (gpt, gpt2, llama); ",
                  "--model ", m.kind, " has none: plan it with --params ", models::parameter_count(m));
  plan::DecoderShape s;
  s.kind = m.kind == "llama"  ? plan::ModelKind::kLlama
           : m.kind == "gpt2" ? plan::ModelKind::kGpt2
                              : plan::ModelKind::kGpt;
  s.layers = m.layers;
  s.hidden = m.hidden;
  s.heads = m.heads;
  s.kv_heads = models::kv_heads(m);
  s.ffn_hidden = models::ffn_hidden(m);
  s.vocab = m.vocab;
  s.seq_len = m.seq_len;
  s.max_positions = models::max_positions(m);
  s.tie_embeddings = m.tie_embeddings;
  s.experts = m.experts;
  s.top_k = m.top_k;
  return s;
}

plan::PlanInput planner_input(const TrainConfig& c, int devices, int64_t device_memory) {
  plan::PlanInput in;
  if (models::is_language_model(c.model)) in.shape = decoder_shape(c.model);
  // The kernel the models will run (nn::causal_attention with the resolved kernel).
  in.attention = nn::resolve_attention_kernel(c.model.attention, c.model.seq_len) == nn::AttentionKernel::kFlash
                     ? plan::Attention::kFlash
                     : plan::Attention::kEager;
  in.params = models::parameter_count(c.model);
  in.micro_batch = c.micro_batch;
  in.global_batch = c.global_batch;
  in.precision = c.precision == "bf16-mixed" ? plan::Precision::kBf16Mixed : plan::Precision::kFp32;
  in.optimizer = c.optimizer == "sgd" ? plan::OptimizerKind::kSgd : plan::OptimizerKind::kAdam;
  in.momentum = c.optimizer == "sgd" ? c.momentum : 0;
  in.activation_checkpointing = c.activation_checkpointing != "none";  // every-N: between none and blocks
  in.max_cp = c.cp;  // a run that splits sequences may be told a split that fits
  in.max_ep = c.ep;
  in.devices = devices;
  in.devices_per_node = devices;
  in.device_memory = device_memory;
  in.memory_margin = 0;
  return in;
}

int64_t total_memory_bytes() {
  return std::min(meminfo_bytes("MemTotal:"), read_number("/sys/fs/cgroup/memory.max"));
}

int64_t available_memory_bytes() {
  int64_t available = meminfo_bytes("MemAvailable:");
  const int64_t limit = read_number("/sys/fs/cgroup/memory.max");
  if (limit != std::numeric_limits<int64_t>::max()) {
    available = std::min(available, limit - std::min(limit, read_number("/sys/fs/cgroup/memory.current")));
  }
  return available;
}

int64_t estimated_rank_bytes(const TrainConfig& c) {
  const plan::PlanInput in = planner_input(c, c.dp * c.pp * c.tp * c.cp, std::numeric_limits<int64_t>::max() / 4);
  if (in.shape) return plan::estimate_layout(in, plan::Layout{c.dp, c.pp, c.tp, c.zero, c.cp, c.ep}).memory.total();
  // The MLP: no shape the planner knows; its model state, shared by the stages and tp slices
  // (estimated as dp ranks of the whole model, then divided).
  const plan::PlanInput whole = planner_input(c, c.dp, std::numeric_limits<int64_t>::max() / 4);
  const plan::Estimate e = plan::estimate_layout(whole, plan::Layout{c.dp, 1, 1, c.zero});
  return (e.memory.parameters + e.memory.gradients + e.memory.optimizer) / (c.pp * c.tp);
}

void check_memory_fits(const TrainConfig& c, int world_size, int local_ranks, int64_t available) {
  const int64_t per_rank = estimated_rank_bytes(c);
  const int64_t need = per_rank > std::numeric_limits<int64_t>::max() / std::max(1, local_ranks)
                           ? std::numeric_limits<int64_t>::max()
                           : per_rank * std::max(1, local_ranks);
  MESHTRAIN_CHECK(need <= available, "meshtrain: this configuration needs about ", gib(per_rank), " per rank (the ",
                  "planner's estimate of ", models::parameter_count(c.model), " parameters with gradients, optimizer ",
                  "state and activations), ", local_ranks, local_ranks == 1 ? " rank" : " ranks", " on this machine: ",
                  gib(need), ", but it has ", gib(available), " available; ", suggestion(c, world_size, local_ranks, available),
                  " (MESHTRAIN_SKIP_MEMORY_CHECK=1 skips this check)");
}

}  // namespace train
}  // namespace meshtrain
