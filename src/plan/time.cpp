// The step-time prediction (time.h): alpha-beta collectives per link class,
// compute at the declared rate, the bubble, and the overlap of
// Note [What the step time overlaps].
#include "plan/time.h"

#include <algorithm>
#include <cmath>

#include "meshtrain/plan.h"

namespace meshtrain {
namespace plan {

namespace {

// meshtrain's (and torch's) DDP / ZeRO bucket cap: 25 MiB.
constexpr double kBucketCapBytes = 25.0 * 1024 * 1024;

Link intra(const PlanInput& in) { return {in.intra_node_bandwidth, in.intra_node_latency}; }
Link inter(const PlanInput& in) { return {in.inter_node_bandwidth, in.inter_node_latency}; }

// Buckets a gradient buffer of `bytes` is reduced in (one message per bucket and ring step).
double buckets(double bytes) { return std::max(1.0, std::ceil(bytes / kBucketCapBytes)); }

// A bucketed collective over a buffer of `bytes`: `one` is the time of one
// collective of a given size; every bucket pays its own latencies.
template <typename Collective>
double bucketed(double bytes, Collective one) {
  const double k = buckets(bytes);
  return k * one(bytes / k);
}

// Of a reduction overlapped with a backward of `window` seconds, what stays
// exposed: the part beyond the window, and the last bucket (it can only start
// when the backward ends).
double exposed_after(double reduction, double last_bucket, double window) {
  return std::max(0.0, reduction - last_bucket - window) + last_bucket;
}

// The data axis of one stage: see Note [What the step time overlaps].
void dp_time(const PlanInput& in, const Layout& l, int64_t psi, int64_t m, double backward_per_mb, StageTime& t) {
  const int n = l.replicas();
  if (n <= 1) return;
  const StateBytesPerParam b = state_bytes_per_param(in.precision, in.optimizer, in.momentum > 0);
  const Link link = dp_link(in, l);
  const double grads = static_cast<double>(psi) * b.gradients, params = static_cast<double>(psi) * b.parameters;
  const double k = buckets(grads);
  auto reduce = [&](double bytes) {
    return l.zero == 0 ? ring_all_reduce_seconds(bytes, n, link) : ring_all_gather_seconds(bytes, n, link);
  };
  auto gather = [&](double bytes) { return ring_all_gather_seconds(bytes, n, link); };
  const double one_reduction = bucketed(grads, reduce), last_bucket = one_reduction / k;
  const double reductions = l.zero >= 2 ? static_cast<double>(m) : 1.0;  // ZeRO-2, -3: every micro-batch
  double gathers = 0;                                                     // parameters, after the step or per use
  if (l.zero == 1 || l.zero == 2) gathers = 1;
  if (l.zero == 3) gathers = 2.0 * static_cast<double>(m);
  const double gather_time = gathers * bucketed(params, gather);
  t.dp = reductions * one_reduction + gather_time;
  t.dp_exposed = in.grad_overlap
                     ? reductions * exposed_after(one_reduction, last_bucket, backward_per_mb) + gather_time
                     : t.dp;
}

}  // namespace

double transfer_seconds(double bytes, const Link& link) { return link.latency + bytes / link.bandwidth; }

double ring_all_reduce_seconds(double bytes, int n, const Link& link) {
  return n <= 1 ? 0.0 : 2.0 * ring_all_gather_seconds(bytes, n, link);
}

double ring_all_gather_seconds(double bytes, int n, const Link& link) {
  return n <= 1 ? 0.0 : (n - 1) * transfer_seconds(bytes / n, link);
}

Link tp_link(const PlanInput& in, const Layout& l) {
  return devices_per_node_of(in) % l.tp == 0 ? intra(in) : inter(in);
}

Link pp_link(const PlanInput& in, const Layout& l) {
  return devices_per_node_of(in) % (l.pp * l.tp) == 0 ? intra(in) : inter(in);
}

Link dp_link(const PlanInput& in, const Layout&) { return in.devices <= devices_per_node_of(in) ? intra(in) : inter(in); }

double megatron_step_flops(const DecoderShape& s, int64_t global_batch, bool recomputation) {
  const double h = static_cast<double>(s.hidden), l = static_cast<double>(s.layers);
  const double seq = static_cast<double>(s.seq_len), v = static_cast<double>(s.vocab);
  return (recomputation ? 96.0 : 72.0) * static_cast<double>(global_batch) * seq * l * h * h *
         (1 + seq / (6 * h) + v / (16 * l * h));
}

int virtual_stages_of(const PlanInput& in, const Layout& l, int64_t microbatches) {
  if (in.schedule != Schedule::kInterleaved || l.pp <= 1 || !in.shape) return 1;
  const bool runs = microbatches % l.pp == 0 && num_pieces(*in.shape) >= static_cast<int64_t>(l.pp) * in.virtual_stages;
  return runs ? in.virtual_stages : 1;
}

double pipeline_bubble_seconds(double busy_seconds, int pp, int64_t microbatches, int virtual_stages) {
  return busy_seconds * (pp - 1) / (static_cast<double>(microbatches) * virtual_stages);
}

StageTime stage_time(const PlanInput& in, const Layout& l, int stage, int64_t m) {
  StageTime t;
  if (!in.shape) {  // only the data axis is known
    dp_time(in, l, in.params, m, 0.0, t);
    return t;
  }
  const DecoderShape& s = *in.shape;
  const bool ckpt = in.activation_checkpointing;
  const double tokens = static_cast<double>(m * in.micro_batch * s.seq_len);
  // Under cp, `in` is one rank's (seq_len / cp positions) but each of its
  // queries still attends over the whole sequence: the scores per token are the full shape's.
  DecoderShape whole = s;
  whole.seq_len = s.seq_len * l.cp;
  t.compute = tokens * stage_flops_per_token(whole, l.pp, l.tp, stage, ckpt, in.attention) / in.device_flops;
  // Backward's share of a micro-batch: 4 of 6 FLOPs per weight, 4 of 8 plus
  // the recomputed forward (6 of 8) with checkpointing.
  const double backward_per_mb = t.compute / static_cast<double>(m) * (ckpt ? 6.0 / 8 : 4.0 / 6);
  const double hidden_bytes =
      static_cast<double>(in.micro_batch * s.seq_len * s.hidden) * activation_bytes_per_value(in.precision);
  // tp: 2 all-reduces forward, 2 backward per block, 2 more when the forward is recomputed.
  const double blocks = static_cast<double>(blocks_on_stage(s, l.pp, stage));
  t.tp = blocks * static_cast<double>(m) * (ckpt ? 6 : 4) * ring_all_reduce_seconds(hidden_bytes, l.tp, tp_link(in, l));
  if (l.pp > 1) {
    // Per micro-batch and chunk, an activation out and a gradient back. With
    // Megatron's scatter/gather (§4.1) each tp rank sends 1/tp of it and the
    // receivers all-gather it inside their node.
    const int v = virtual_stages_of(in, l, m);
    const bool split = in.p2p_scatter_gather && l.tp > 1;
    const double one = split ? transfer_seconds(hidden_bytes / l.tp, pp_link(in, l)) +
                                   ring_all_gather_seconds(hidden_bytes, l.tp, tp_link(in, l))
                             : transfer_seconds(hidden_bytes, pp_link(in, l));
    t.pp = 2.0 * v * static_cast<double>(m) * one;
  }
  if (l.cp > 1) {
    // Ring hops per block and micro-batch: cp - 1 forward (twice with
    // recomputation), cp - 1 + cp backward; every hop pays its latency.
    const Link link = devices_per_node_of(in) % (l.cp * l.tp) == 0 ? intra(in) : inter(in);
    const double hops = (ckpt ? 2.0 : 1.0) * (l.cp - 1) + (l.cp - 1) + l.cp;
    const double bytes = static_cast<double>(cp_bytes_per_block(s, in.micro_batch, l.tp, l.cp, in.precision, ckpt));
    t.cp = blocks * static_cast<double>(m) * (hops * link.latency + bytes / link.bandwidth);
  }
  if (l.ep > 1) {
    // All-to-alls per block and micro-batch: dispatch and combine forward
    // (twice with recomputation) and backward, each ep - 1 messages. An ep
    // group is ep consecutive ranks of dp x cp, which span at most ep pp cp tp ranks.
    const Link link = devices_per_node_of(in) % (l.ep * l.pp * l.cp * l.tp) == 0 ? intra(in) : inter(in);
    const double messages = (ckpt ? 6.0 : 4.0) * (l.ep - 1);
    const double bytes = static_cast<double>(ep_bytes_per_block(s, in.micro_batch, l.ep, in.precision, ckpt));
    t.ep = blocks * static_cast<double>(m) * (messages * link.latency + bytes / link.bandwidth);
  }
  // The experts' gradients go over their replicas (dp x cp / ep), the rest over dp x cp.
  dp_time(in, l, stage_replicated_parameter_count(s, l, stage) + stage_expert_parameter_count(s, l, stage), m,
          backward_per_mb, t);
  return t;
}

}  // namespace plan
}  // namespace meshtrain
