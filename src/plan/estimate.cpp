#include "meshtrain/plan.h"

#include <algorithm>
#include <cmath>

#include "plan/time.h"
#include "meshtrain/util.h"

namespace meshtrain {
namespace plan {

namespace {

// meshtrain's (and torch's) DDP / ZeRO bucket cap: 25 MiB.
constexpr int64_t kBucketCapBytes = 25 * 1024 * 1024;

// b*s*h values: one micro-batch's activation between two blocks.
int64_t hidden_state_values(const DecoderShape& s, int64_t micro_batch) { return micro_batch * s.seq_len * s.hidden; }

// What one rank of a cp > 1 layout computes on: seq_len / cp positions, ring
// attention's flash activations (the global batch stays the whole model's).
PlanInput cp_rank_input(const PlanInput& in, int cp) {
  if (cp == 1 || !in.shape) return in;
  PlanInput local = in;
  local.global_batch = global_batch_of(in);
  local.shape = cp_local_shape(*in.shape, cp);
  local.attention = Attention::kFlash;
  return local;
}

// Parameters one rank of `stage` holds before ZeRO: the stage's share for a
// known shape, the whole count when only --params is known (then pp = tp = 1).
// Under expert parallelism, without the experts (stage_experts).
int64_t stage_params(const PlanInput& in, const Layout& l, int stage) {
  if (!in.shape) return in.params;
  return stage_replicated_parameter_count(*in.shape, l, stage);
}

// The experts one rank holds apart under expert parallelism (0 otherwise).
int64_t stage_experts(const PlanInput& in, const Layout& l, int stage) {
  return in.shape ? stage_expert_parameter_count(*in.shape, l, stage) : 0;
}

}  // namespace

namespace {

// Memory held for communication, beyond the model state.
int64_t stage_buffers(const PlanInput& in, const Layout& l, int stage, int64_t psi) {
  const StateBytesPerParam b = state_bytes_per_param(in.precision, in.optimizer, in.momentum > 0);
  int64_t bytes = 0;
  const int n = l.replicas();
  if (n > 1 && l.zero == 0) bytes += b.gradients * psi;  // DDP's buckets mirror the gradients (engine_dp.cpp)
  // Stage 1 reduce-scatters in place in its full gradient buffer: nothing extra.
  if (n > 1 && l.zero == 2)
    bytes += std::min<int64_t>(2 * kBucketCapBytes, b.gradients * psi);  // filling + reducing
  if (n > 1 && l.zero == 3 && in.shape) {
    // The unit being used and the prefetched one, gathered; one unit's full gradient before its reduce-scatter.
    const int64_t unit = largest_unit_parameter_count(*in.shape, l.pp, l.tp, stage);
    bytes += (2 * b.parameters + b.gradients) * unit;
  }
  if (in.shape) {
    // A head tied to an embedding on another stage receives its weight each step and sends back the gradient.
    bytes += (b.parameters + b.gradients) * tied_weight_copy_count(*in.shape, l.pp, l.tp, stage);
  }
  // Experts held apart, over their replicas: DDP's buckets, or ZeRO-2's (ZeRO-3 reduces them as ZeRO-2).
  if (l.expert_replicas() > 1 && l.zero == 0) bytes += b.gradients * stage_experts(in, l, stage);
  if (l.expert_replicas() > 1 && l.zero >= 2)
    bytes += std::min<int64_t>(2 * kBucketCapBytes, b.gradients * stage_experts(in, l, stage));
  if (l.pp > 1 && in.shape) {
    // One receive and one send buffer of b*s*h values.
    bytes += 2 * hidden_state_values(*in.shape, in.micro_batch) * activation_bytes_per_value(in.precision);
  }
  return bytes;
}

CommBytes stage_comm(const PlanInput& in, const Layout& l, int stage, int64_t microbatches) {
  const StateBytesPerParam b = state_bytes_per_param(in.precision, in.optimizer, in.momentum > 0);
  CommBytes c;
  c.dp = dp_comm_bytes(stage_params(in, l, stage), b.gradients, l.zero, l.replicas(), microbatches) +
         dp_comm_bytes(stage_experts(in, l, stage), b.gradients, std::min(l.zero, 2), l.expert_replicas(),
                       microbatches);
  if (in.shape) {
    const int64_t blocks = blocks_on_stage(*in.shape, l.pp, stage);
    c.ep = blocks * microbatches *
           ep_bytes_per_block(*in.shape, in.micro_batch, l.ep, in.precision, in.activation_checkpointing);
    c.cp = blocks * microbatches *
           cp_bytes_per_block(*in.shape, in.micro_batch, l.tp, l.cp, in.precision, in.activation_checkpointing);
    c.pp = pp_comm_bytes(*in.shape, in.micro_batch, l.pp, stage, microbatches, in.precision);
    c.tp = tp_comm_bytes(*in.shape, in.micro_batch, l.tp, blocks, microbatches, in.precision,
                         in.activation_checkpointing);
  }
  return c;
}

// The slowest stage's time (its busy time, then its bubble) into `e`.
void add_time(const PlanInput& in, const Layout& l, Estimate& e) {
  double slowest = -1;
  for (int stage = 0; stage < l.pp; ++stage) {
    const StageTime t = stage_time(in, l, stage, e.microbatches);
    if (t.busy() <= slowest) continue;
    slowest = t.busy();
    e.comm_stage = stage;
    e.comm = stage_comm(in, l, stage, e.microbatches);
    e.seconds = CommSeconds{t.dp, t.pp, t.tp, t.cp, t.ep};
    e.dp_exposed_seconds = t.dp_exposed;
    e.compute_seconds = t.compute;
  }
  e.virtual_stages = virtual_stages_of(in, l, e.microbatches);
  // The bubble's idle slots are micro-batch slots: compute and the
  // communication inside each micro-batch (tp, pp), not the step's dp.
  e.bubble_seconds = pipeline_bubble_seconds(e.compute_seconds + e.seconds.tp + e.seconds.pp + e.seconds.ep, l.pp,
                                             e.microbatches, e.virtual_stages);
}

}  // namespace

double stage_flops_per_token(const DecoderShape& s, int pp, int tp, int stage, bool checkpointing,
                             Attention attention) {
  const double per_weight = checkpointing ? 8.0 : 6.0;
  const double blocks = static_cast<double>(blocks_on_stage(s, pp, stage));
  const double scores = blocks * s.seq_len * s.hidden / tp;
  // Forward 4 s h (twice with checkpointing), backward 8 s h, + 2 s h for
  // flash attention's recomputed scores (FlashAttention's backward, Dao et al. 2022, §3.1).
  const double per_score = 2 * per_weight + (attention == Attention::kFlash ? 2.0 : 0.0);
  double weights = blocks * block_active_parameter_count(s, tp);
  if (stage == pp - 1) weights += static_cast<double>(embedding_rows(s) / tp) * s.hidden;  // the LM head's matmul
  return per_weight * weights + per_score * scores;
}

int64_t ring_all_reduce_bytes(int64_t bytes, int n) {
  return n <= 1 ? 0 : std::llround(2.0 * (n - 1) / n * static_cast<double>(bytes));
}

int64_t dp_comm_bytes(int64_t psi, int value_bytes, int zero, int dp, int64_t microbatches) {
  if (dp <= 1) return 0;
  const double one_pass = static_cast<double>(psi) * value_bytes * (dp - 1) / dp;  // reduce-scatter or all-gather
  double passes = 2;                                                               // DDP, stage 1
  if (zero == 2) passes = static_cast<double>(microbatches) + 1;                   // RS per micro-batch + AG
  if (zero == 3) passes = 3.0 * static_cast<double>(microbatches);                 // AG fwd + AG bwd + RS
  return std::llround(passes * one_pass);
}

int64_t pp_comm_bytes(const DecoderShape& s, int64_t micro_batch, int pp, int stage, int64_t microbatches,
                      Precision precision) {
  const int neighbours = (stage > 0 ? 1 : 0) + (stage < pp - 1 ? 1 : 0);
  return neighbours * microbatches * hidden_state_values(s, micro_batch) * activation_bytes_per_value(precision);
}

int64_t tp_comm_bytes(const DecoderShape& s, int64_t micro_batch, int tp, int64_t blocks, int64_t microbatches,
                      Precision precision, bool checkpointing) {
  const int64_t one = hidden_state_values(s, micro_batch) * activation_bytes_per_value(precision);
  return (checkpointing ? 6 : 4) * blocks * microbatches * ring_all_reduce_bytes(one, tp);
}

int64_t ep_bytes_per_block(const DecoderShape& local, int64_t micro_batch, int ep, Precision precision,
                           bool checkpointing) {
  if (ep <= 1 || local.experts == 0) return 0;
  const double routes = static_cast<double>(micro_batch * local.seq_len * local.top_k) * (ep - 1) / ep;
  const double rows = routes * static_cast<double>(local.hidden) * activation_bytes_per_value(precision);
  const double dispatches = checkpointing ? 2.0 : 1.0;
  return std::llround((2 * dispatches + 2) * rows + dispatches * routes * 8.0);
}

DecoderShape cp_local_shape(const DecoderShape& shape, int cp) {
  DecoderShape local = shape;
  local.seq_len = shape.seq_len / cp;
  return local;
}

int64_t cp_bytes_per_block(const DecoderShape& local, int64_t micro_batch, int tp, int cp, Precision precision,
                           bool checkpointing) {
  if (cp <= 1) return 0;
  const double kv = 2.0 * static_cast<double>(micro_batch * local.seq_len) * kv_heads_of(local) *
                    static_cast<double>(local.hidden / local.heads) / tp;
  const double sent = kv * activation_bytes_per_value(precision);
  return std::llround((checkpointing ? 2.0 : 1.0) * (cp - 1) * sent + (cp - 1) * sent + cp * kv * 4.0);
}

std::vector<Layout> candidate_layouts(const PlanInput& in) {
  std::vector<Layout> layouts;
  const int64_t micro_steps = global_batch_of(in) / in.micro_batch;
  // Without a shape only data parallelism can be estimated; with one, tp
  // divides the heads and pp is at most the number of pieces.
  const int64_t max_tp = in.shape ? std::min<int64_t>(in.devices, in.shape->heads) : 1;
  const int max_cp = in.shape ? std::max(1, in.max_cp) : 1;
  for (int cp = 1; cp <= max_cp; ++cp) {
    if (in.devices % cp != 0) continue;
    const int devices = in.devices / cp;  // per cp rank of every sequence
    for (int tp = 1; tp <= max_tp; ++tp) {
      if (devices % tp != 0) continue;
      const int64_t max_pp = in.shape ? std::min<int64_t>(devices / tp, num_pieces(*in.shape)) : 1;
      for (int pp = 1; pp <= max_pp; ++pp) {
        if ((devices / tp) % pp != 0) continue;
        const int dp = devices / tp / pp;
        if (in.shape && !layout_problem(*in.shape, Layout{dp, pp, tp, 0, cp}).empty()) continue;
        if (micro_steps % dp != 0) continue;
        for (int ep = 1; ep <= std::min(dp * cp, in.shape ? std::max(1, in.max_ep) : 1); ++ep) {
          if (ep > 1 && !layout_problem(*in.shape, Layout{dp, pp, tp, 0, cp, ep}).empty()) continue;
          for (int zero = 0; zero <= (dp * cp > 1 ? 3 : 0); ++zero) layouts.push_back({dp, pp, tp, zero, cp, ep});
        }
      }
    }
  }
  return layouts;
}

MemoryBytes stage_memory(const PlanInput& in, const Layout& l, int stage, int64_t microbatches) {
  const int64_t psi = stage_params(in, l, stage);
  const StateBytesPerParam per = state_bytes_per_param(in.precision, in.optimizer, in.momentum > 0);
  const ModelStateBytes state = zero_model_state(psi, per, l.zero, l.replicas());
  // The experts held apart: ZeRO 1 or 2 over their replicas (2 under ZeRO-3).
  const ModelStateBytes experts =
      zero_model_state(stage_experts(in, l, stage), per, std::min(l.zero, 2), l.expert_replicas());
  MemoryBytes m;
  m.parameters = state.parameters + experts.parameters;
  m.gradients = state.gradients + experts.gradients;
  m.optimizer = state.optimizer + experts.optimizer;
  m.activations = stage_activation_bytes(in, l, stage, microbatches);
  m.buffers = stage_buffers(in, l, stage, psi);
  return m;
}

Estimate estimate_layout(const PlanInput& given, const Layout& l) {
  const int64_t micro_steps = global_batch_of(given) / given.micro_batch;
  MESHTRAIN_CHECK(l.dp * l.pp * l.tp * l.cp == given.devices && micro_steps % l.dp == 0, "layout dp=", l.dp, " pp=",
                  l.pp, " tp=", l.tp, l.cp > 1 ? str_cat(" cp=", l.cp) : "", " does not fit ", given.devices,
                  " devices and ", micro_steps, " micro-batches per step");
  MESHTRAIN_CHECK(l.cp == 1 || given.shape, "context parallelism (cp ", l.cp, ") needs the model's shape, not --params");
  MESHTRAIN_CHECK(l.ep == 1 || (given.shape && layout_problem(*given.shape, l).empty()), "expert parallelism (ep ",
                  l.ep, ") needs a model with --experts divisible by ep, and ep dividing dp x cp");
  const PlanInput in = cp_rank_input(given, l.cp);  // every figure below is one rank's
  Estimate e;
  e.layout = l;
  e.microbatches = micro_steps / l.dp;
  // Balanced stages differ (the first holds the embeddings and the most
  // micro-batches in flight, the last the head): report the worst of each.
  for (int stage = 0; stage < l.pp; ++stage) {
    const MemoryBytes memory = stage_memory(in, l, stage, e.microbatches);
    if (stage == 0 || memory.total() > e.memory.total()) {
      e.memory = memory;
      e.memory_stage = stage;
    }
  }
  add_time(in, l, e);
  if (given.shape) {
    e.tokens = global_batch_of(given) * given.shape->seq_len;
    e.model_flops = static_cast<double>(e.tokens) *
                    stage_flops_per_token(*given.shape, 1, 1, 0, in.activation_checkpointing, in.attention);
  }
  e.tp_in_node = devices_per_node_of(in) % l.tp == 0;
  e.fits = static_cast<double>(e.memory.total()) <= usable_memory(in);
  return e;
}

}  // namespace plan
}  // namespace meshtrain
