#pragma once
// Step time of one layout, predicted: compute at the device's achieved rate,
// communication from an alpha-beta model per link class (a message costs the
// link's latency alpha plus bytes / bandwidth beta^-1), the pipeline's bubble,
// and what overlaps what (Note [What the step time overlaps]). Pure arithmetic.
//
// Note [What the step time overlaps]
// - tp: every all-reduce of a block's forward, its recomputation and its
//   backward is on the critical path (the next matmul needs its result).
// - pp: each micro-batch's activation (forward) and gradient (backward)
//   crosses each stage boundary on the critical path: meshtrain's executor
//   waits for the receive before it computes.
// - dp: with overlap (meshtrain's DDP default, docs/dp.md) the gradient
//   reduction of the synchronizing micro-batch runs bucket by bucket during
//   its backward: only what exceeds that backward, plus the last bucket, is
//   exposed; ZeRO-2 and -3 reduce-scatter every micro-batch, each hidden
//   behind that micro-batch's backward the same way; the all-gathers (ZeRO-1
//   and -2 after the step, ZeRO-3 before each use) are counted exposed.
//   Without overlap (the trainer's --no-overlap; Megatron-LM 2021 reduced its
//   gradients after the backward) all of it is exposed.

#include <cstdint>

#include "meshtrain/plan.h"

namespace meshtrain {
namespace plan {

// One link class: per device and direction.
struct Link {
  double bandwidth = 0;  // bytes/s
  double latency = 0;    // seconds per message (alpha)
};

// One message of `bytes` over `link`: alpha + bytes / bandwidth.
double transfer_seconds(double bytes, const Link& link);

// Ring all-reduce of a `bytes` buffer over n ranks: 2 (n-1) steps, each
// sending bytes / n: 2 (n-1) alpha + 2 (n-1)/n bytes / bandwidth. 0 for n = 1.
double ring_all_reduce_seconds(double bytes, int n, const Link& link);

// Ring all-gather (or reduce-scatter) whose full buffer is `bytes`: (n-1)
// steps of bytes / n: (n-1) alpha + (n-1)/n bytes / bandwidth. 0 for n = 1.
double ring_all_gather_seconds(double bytes, int n, const Link& link);

// The links each axis of layout `l` uses: tp inside a node when tp divides
// devices-per-node, a pipeline when pp * tp does, dp only on a single node
// (ranks follow arange(world).view(dp, pp, tp)).
Link tp_link(const PlanInput& input, const Layout& l);
Link pp_link(const PlanInput& input, const Layout& l);
Link dp_link(const PlanInput& input, const Layout& l);

// The FLOPs of one training step of a GPT by Narayanan et al. 2021 (SC21,
// §5.1, Eq. 3): 96 B s l h^2 (1 + s/(6h) + V/(16 l h)) with full activation
// recomputation (four passes: forward, recomputed forward, backward twice a
// forward), 72 B s l h^2 (...) without. B sequences per step. The paper's
// achieved TFLOP/s are this over step time and devices.
double megatron_step_flops(const DecoderShape& shape, int64_t global_batch, bool recomputation);

// Virtual stages a layout's pipeline runs: input.virtual_stages under the
// interleaved schedule when the trainer can run it (pp > 1, the micro-batches
// a multiple of pp, at least pp * V pieces), otherwise 1 (1F1B).
int virtual_stages_of(const PlanInput& input, const Layout& l, int64_t microbatches);

// The bubble: (p-1)/(V m) of the busy time of the slowest stage (1F1B with
// V = 1, Narayanan et al. 2021 §2.2; interleaved §2.2.2).
double pipeline_bubble_seconds(double busy_seconds, int pp, int64_t microbatches, int virtual_stages = 1);

// One pipeline stage's step, in seconds.
struct StageTime {
  double compute = 0;     // forward + backward (+ recomputation) at device_flops
  double tp = 0;          // tensor-parallel all-reduces (critical path)
  double pp = 0;          // activations and gradients between stages (critical path)
  double dp = 0;          // data-parallel collectives, in full
  double dp_exposed = 0;  // what of dp is not hidden behind backward
  double cp = 0;          // ring attention's keys and values (critical path, not overlapped)
  double ep = 0;          // the experts' all-to-alls (critical path)
  double busy() const { return compute + tp + pp + cp + ep + dp_exposed; }
};

// Stage `stage` of layout `l` with m micro-batches per step (per dp rank).
// Needs input.shape.
StageTime stage_time(const PlanInput& input, const Layout& l, int stage, int64_t microbatches);

}  // namespace plan
}  // namespace meshtrain
