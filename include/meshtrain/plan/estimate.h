#pragma once
// Per-device estimates for one layout: memory (model state, activations,
// communication buffers), bytes communicated per step, and the time those
// bytes take on the links. Each formula is a small named function citing its
// source; estimate_layout puts them together, stage by stage.
//
// Notation: s sequence length, b micro-batch, h hidden, a heads, v vocabulary,
// t tp degree, n the size of the group a collective runs in.

#include <cstdint>
#include <vector>

#include "meshtrain/plan/input.h"
#include "meshtrain/plan/model.h"

namespace meshtrain {
namespace plan {

struct MemoryBytes {
  int64_t parameters = 0, gradients = 0, optimizer = 0, activations = 0, buffers = 0;
  int64_t total() const { return parameters + gradients + optimizer + activations + buffers; }
};

// Bytes one device sends per optimizer step, by mesh axis.
struct CommBytes {
  int64_t dp = 0, pp = 0, tp = 0, cp = 0, ep = 0;
  int64_t total() const { return dp + pp + tp + cp + ep; }
};

// Seconds those bytes take on the link each axis uses (no overlap assumed).
struct CommSeconds {
  double dp = 0, pp = 0, tp = 0, cp = 0, ep = 0;
  double total() const { return dp + pp + tp + cp + ep; }
};

struct Estimate {
  Layout layout;
  int64_t microbatches = 1;  // per dp rank per step: global / (micro * dp)
  int memory_stage = 0;      // the pipeline stage whose memory is reported (the largest)
  MemoryBytes memory;
  int comm_stage = 0;  // the stage whose time is reported (the slowest: compute + communication)
  CommBytes comm;
  CommSeconds seconds;
  double dp_exposed_seconds = 0;  // of seconds.dp, what the backward does not hide (time.h)
  double compute_seconds = 0;     // that stage's forward + backward (+ recomputation) at device_flops
  double bubble_seconds = 0;      // the pipeline's idle time: (p-1)/(V m) of the stage's busy time
  int virtual_stages = 1;         // chunks per pipeline rank the schedule runs (1: 1F1B)
  double model_flops = 0;         // per step, the whole model (stage_flops_per_token, recomputation included)
  int64_t tokens = 0;             // per step
  bool tp_in_node = true;         // each tp group lies inside one node
  bool fits = false;              // memory.total() <= usable_memory
  // Predicted step time: compute, bubble, tp and pp communication (on the
  // critical path) and the exposed part of dp (Note [What the step time overlaps]).
  double step_seconds() const {
    return compute_seconds + bubble_seconds + seconds.tp + seconds.pp + seconds.cp + seconds.ep + dp_exposed_seconds;
  }
  double tokens_per_second() const { return step_seconds() > 0 ? tokens / step_seconds() : 0; }
  // Model FLOP/s per device (the convention of Narayanan et al.: recomputation counts).
  double flops_per_device(int devices) const {
    return step_seconds() > 0 ? model_flops / step_seconds() / devices : 0;
  }
};

// ---- Activations (Korthikanti et al. 2022, "Reducing Activation Recomputation
// in Large Transformer Models", §4), in src/plan/activations.cpp.

// One transformer layer, one micro-batch, tensor parallel without sequence
// parallelism (§4.2.2), in bytes.
//   gpt, gpt2  the paper's s*b*h*(10 + (8 + 4F/h)/t) in 16-bit (F = 4h gives
//              10 + 24/t, and t = 1 §4.1's 34), plus attention's
//              eager  5*a*s^2*b/t (softmax output 2, its dropout mask 1 and
//                     output 2 bytes per score),
//              flash  the log-sum-exp of each row, a*s*b/t fp32 values;
//              fp32 doubles the 16-bit figures (an over-estimate: the paper's
//              1-byte dropout masks count as 2, and meshtrain's GPT has no
//              dropout).
//   llama      every tensor meshtrain's Llama block keeps for backward (the
//              list is in activations.cpp): the norms, the rotary q and k, v,
//              attention's output, SwiGLU's 4*s*b*F/t, plus
//              eager  the softmax a*s^2*b/t (k, v repeated to every query head),
//              flash  k, v at kv_heads and the fp32 log-sum-exp a*s*b/t.
int64_t layer_activation_bytes(const DecoderShape& shape, int64_t micro_batch, int tp, Precision precision,
                               Attention attention = Attention::kEager);

// With full activation checkpointing a layer keeps only its input, s*b*h
// values (2*s*b*h bytes in 16-bit, §5), replicated over tp.
int64_t checkpointed_layer_bytes(const DecoderShape& shape, int64_t micro_batch, Precision precision);

// The final norm, output projection and cross-entropy on the last stage,
// 4*s*b*h*(1 + v/h)/t bytes in 16-bit (§4.3; v the embedding's rows), doubled for fp32.
int64_t output_layer_activation_bytes(const DecoderShape& shape, int64_t micro_batch, int tp, Precision precision);

// Micro-batches whose activations stage `stage` holds at once under 1F1B
// (Narayanan et al. 2021, PipeDream-Flush): pp - stage on stage `stage`, at
// most the number of micro-batches; without a pipeline, one (accumulation).
int64_t microbatches_in_flight(int pp, int stage, int64_t microbatches);

// Activations stage `stage` of layout `l` holds at its peak: its blocks times
// the micro-batches in flight (layer inputs only, plus one layer being
// recomputed, with checkpointing), and on the last stage the output layer's.
// 0 without a shape.
int64_t stage_activation_bytes(const PlanInput& input, const Layout& l, int stage, int64_t microbatches);

// ---- Communication per device per step.

// A ring all-reduce of `bytes` over n ranks sends 2 (n-1)/n * bytes per rank
// (reduce-scatter + all-gather, each (n-1)/n).
int64_t ring_all_reduce_bytes(int64_t bytes, int n);

// The data axis, for psi parameters (ZeRO paper §7): DDP and stage 1 all-reduce
// the gradients once per step, 2 psi (n-1)/n; stage 2 reduce-scatters them
// psi (n-1)/n and all-gathers the parameters psi (n-1)/n; stage 3 gathers the
// parameters twice and reduce-scatters the gradients, 3 psi (n-1)/n. Under
// gradient accumulation meshtrain's stages 2 and 3 reduce every micro-batch
// (docs/zero.md), so their reduce-scatter (and stage 3's gathers) repeat
// `microbatches` times; with one micro-batch this is exactly the paper's.
int64_t dp_comm_bytes(int64_t psi, int value_bytes, int zero, int dp, int64_t microbatches);

// The pipeline axis: per micro-batch, the activation (forward) and its
// gradient (backward), b*s*h values, cross each stage boundary; a stage sends
// one to each neighbour it has.
int64_t pp_comm_bytes(const DecoderShape& shape, int64_t micro_batch, int pp, int stage, int64_t microbatches,
                      Precision precision);

// The tensor axis (Megatron-LM, Shoeybi et al. 2019, §3): per block and
// micro-batch 4 all-reduces of b*s*h values (2 forward: attention and MLP
// outputs; 2 backward: their inputs' gradients), ring volume 2 (t-1)/t each;
// 6 with activation checkpointing (the recomputed forward repeats its 2).
int64_t tp_comm_bytes(const DecoderShape& shape, int64_t micro_batch, int tp, int64_t blocks, int64_t microbatches,
                      Precision precision, bool checkpointing = false);
// The context axis (ring attention, src/cp/ring_attention.cpp), per block and
// micro-batch, for a rank's `local` shape (seq_len / cp positions): forward
// passes its keys and values cp - 1 hops, 2 b s kv_heads d / tp values; the
// backward passes them again with their fp32 gradients, (cp - 1) kv + cp dkv;
// a recomputed forward repeats the first. Counted as not overlapped.
int64_t cp_bytes_per_block(const DecoderShape& local, int64_t micro_batch, int tp, int cp, Precision precision,
                           bool checkpointing = false);
// The expert axis (models::MoE under ep, ep/all_to_all.h), per block and
// micro-batch: each token's top_k routes go to the experts' ranks and their
// results come back, (ep - 1) / ep of them to other ranks (routes spread
// evenly): dispatch and combine forward (twice with recomputation) and their
// gradients backward, 4 (6) x b s k H values, plus the routes' expert ids
// (8 bytes each) with each dispatch.
int64_t ep_bytes_per_block(const DecoderShape& local, int64_t micro_batch, int ep, Precision precision,
                           bool checkpointing);
// The shape one cp rank computes on: seq_len / cp positions.
DecoderShape cp_local_shape(const DecoderShape& shape, int cp);

// ---- Compute time.

// Training FLOPs per token one tp rank of pipeline stage `stage` performs:
// 6 per weight it multiplies by (2 forward, 4 backward: Kaplan et al. 2020,
// §2.1) — each block's matrices, and the head's [V/tp, H] weight, tied or
// not; the embedding lookup is free — plus attention's scores and weighted
// sum, 12 * s * h / tp per block (4 s h forward, twice that backward). With
// activation checkpointing the forward runs twice: 8 instead of 6, 16 instead
// of 12. Flash attention recomputes the scores in backward: 2 s h more.
double stage_flops_per_token(const DecoderShape& shape, int pp, int tp, int stage, bool checkpointing,
                             Attention attention = Attention::kEager);

// ---- Putting it together.

// Every layout of input.devices ranks meshtrain could run: dp * pp * tp =
// devices, tp dividing what it splits (layout_problem), pp <= layers + 2
// (pieces), dp dividing the micro-batches of a step; ZeRO 0-3 when dp > 1.
// Only dp when the shape is unknown.
std::vector<Layout> candidate_layouts(const PlanInput& input);

// The per-device estimate of one layout (the worst stage for memory and for time).
Estimate estimate_layout(const PlanInput& input, const Layout& layout);

// The memory of one pipeline stage (exposed for the scenario and for tests).
MemoryBytes stage_memory(const PlanInput& input, const Layout& layout, int stage, int64_t microbatches);

}  // namespace plan
}  // namespace meshtrain
