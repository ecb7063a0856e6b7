// Activation memory: what one layer keeps for backward (Korthikanti et al.
// 2022, §4, adapted per model), and what a pipeline stage holds at its peak.
#include <algorithm>
#include <cmath>

#include "meshtrain/plan.h"

namespace meshtrain {
namespace plan {

namespace {

// b*s*h values: one micro-batch's activation between two blocks.
double hidden_state_values(const DecoderShape& s, int64_t micro_batch) {
  return static_cast<double>(micro_batch) * static_cast<double>(s.seq_len) * static_cast<double>(s.hidden);
}

// The log-sum-exp of each score row, which flash attention keeps instead of
// the softmax: a*s*b/t values, in fp32 whatever the precision.
double log_sum_exp_bytes(const DecoderShape& s, int64_t micro_batch, int tp) {
  return 4.0 * static_cast<double>(s.heads) * static_cast<double>(s.seq_len) * micro_batch / tp;
}

// A mixture of experts' activations (models/moe.cpp), whole on every tp
// rank: the router's fp32 probabilities (b s E), and per route (b s k of
// them) its row (the experts' input), the expert's inner values (SwiGLU:
// gate's and up's outputs, silu's, the product: 4F; GELU: fc1's output and
// GELU's: 2F) and its result (weighted at its token): 2H + 4F (2F) values.
double moe_layer_bytes(const DecoderShape& s, int64_t micro_batch, Precision precision) {
  const double tokens = static_cast<double>(micro_batch * s.seq_len), v = activation_bytes_per_value(precision);
  const double inner = (s.kind == ModelKind::kLlama ? 4.0 : 2.0) * static_cast<double>(ffn_hidden_of(s));
  return tokens * (4.0 * s.experts + s.top_k * v * (2.0 * s.hidden + inner));
}

// Korthikanti et al. §4.1-4.2 for gpt and gpt2, with the MLP's inner size F
// for the paper's 4h: 16-bit bytes per s*b*h, 10 replicated over tp (two
// LayerNorm inputs 4, the q/k/v and fc1 inputs 4, two dropout masks 2) and
// (8 + 4F/h)/t split (q and k 4, v 2, proj's input 2; GELU's input and
// fc2's input 2F/h each), plus attention's 5*a*s/(h*t): the softmax output
// 2, its dropout mask 1 and the dropped-out scores 2 (eager only).
double gpt_layer_bytes(const DecoderShape& s, int64_t micro_batch, int tp, Precision precision, Attention attention) {
  const double h = static_cast<double>(s.hidden);
  const double dense_mlp = s.experts > 0 ? 0.0 : 4.0 * static_cast<double>(ffn_hidden_of(s)) / h;
  const double linear = 10.0 + (8.0 + dense_mlp) / tp;
  const double scores = attention == Attention::kEager ? 5.0 * s.heads * s.seq_len / (h * tp) : 0.0;
  const double scale = activation_bytes_per_value(precision) / 2.0;  // the paper counts 16-bit values
  const double lse = attention == Attention::kFlash ? log_sum_exp_bytes(s, micro_batch, tp) : 0.0;
  const double moe = s.experts > 0 ? moe_layer_bytes(s, micro_batch, precision) : 0.0;
  return hidden_state_values(s, micro_batch) * (linear + scores) * scale + lse + moe;
}

// Note [Llama's activations]
// What autograd keeps of one meshtrain Llama block (models/llama.cpp,
// layers.cpp), in values of the training precision (2 bytes for bf16-mixed,
// 4 for fp32) unless said:
//   each of the 2 RMSNorms   its input as fp32 (4 bytes: x.to(float), the
//                            input itself in fp32), the normalized values
//                            and the weighted output (the next matmuls'
//                            input): s*b*h each, replicated over tp
//   attention, eager         the rotary q, k and v repeated to every query
//                            head (repeat_interleave copies them), the
//                            softmax a*s^2*b, the output (o's input): 4 s*b*h + a*s^2*b
//   attention, flash         the rotary q, k and v at kv_heads (no repeat),
//                            the output, and the fp32 log-sum-exp a*s*b:
//                            (2 + 2 kv_heads/heads) s*b*h
//   SwiGLU                   gate's output (silu's input), silu's output,
//                            up's output (both the product's inputs) and
//                            the product (down's input): 4 s*b*F
// Everything but the norms' is split over tp. There are no dropout masks
// (Llama has none) and no rotary inputs (rotation is linear: its backward
// needs only the cos and sin tables). Not counted: the norms' per-row rsqrt
// (s*b fp32 values, 1/h of an input), the causal mask (s^2 booleans shared by
// every head and sample), the model's rotary tables.
double llama_layer_bytes(const DecoderShape& s, int64_t micro_batch, int tp, Precision precision,
                         Attention attention) {
  const double sbh = hidden_state_values(s, micro_batch), v = activation_bytes_per_value(precision);
  const double norms = 2 * (4.0 + 2 * v) * sbh;
  const double mlp = s.experts > 0 ? moe_layer_bytes(s, micro_batch, precision)
                                   : 4 * v * sbh * static_cast<double>(ffn_hidden_of(s)) / static_cast<double>(s.hidden) / tp;
  double attn = 0;
  if (attention == Attention::kEager) {
    const double scores = static_cast<double>(s.heads) * s.seq_len * s.seq_len * micro_batch;
    attn = v * (4 * sbh + scores) / tp;
  } else {
    const double kv_share = static_cast<double>(kv_heads_of(s)) / static_cast<double>(s.heads);
    attn = v * (2 + 2 * kv_share) * sbh / tp + log_sum_exp_bytes(s, micro_batch, tp);
  }
  return norms + attn + mlp;
}

}  // namespace

int64_t layer_activation_bytes(const DecoderShape& s, int64_t micro_batch, int tp, Precision precision,
                               Attention attention) {
  const double bytes = s.kind == ModelKind::kLlama ? llama_layer_bytes(s, micro_batch, tp, precision, attention)
                                                   : gpt_layer_bytes(s, micro_batch, tp, precision, attention);
  return std::llround(bytes);
}

int64_t checkpointed_layer_bytes(const DecoderShape& s, int64_t micro_batch, Precision precision) {
  return std::llround(hidden_state_values(s, micro_batch)) * activation_bytes_per_value(precision);
}

int64_t output_layer_activation_bytes(const DecoderShape& s, int64_t micro_batch, int tp, Precision precision) {
  const double scale = activation_bytes_per_value(precision) / 2.0;
  const double rows = static_cast<double>(embedding_rows(s));
  return std::llround(4.0 * hidden_state_values(s, micro_batch) * (1.0 + rows / s.hidden) / tp * scale);
}

int64_t microbatches_in_flight(int pp, int stage, int64_t microbatches) {
  if (pp == 1) return 1;
  return std::min<int64_t>(pp - stage, microbatches);
}

int64_t stage_activation_bytes(const PlanInput& in, const Layout& l, int stage, int64_t microbatches) {
  if (!in.shape) return 0;  // no shape, no activation estimate (reported as a note)
  const DecoderShape& s = *in.shape;
  const int64_t blocks = blocks_on_stage(s, l.pp, stage);
  const int64_t in_flight = microbatches_in_flight(l.pp, stage, microbatches);
  const int64_t full_layer = layer_activation_bytes(s, in.micro_batch, l.tp, in.precision, in.attention);
  int64_t bytes = 0;
  if (in.activation_checkpointing) {
    // Layer inputs for every micro-batch in flight, plus one layer's full
    // activations while it is recomputed during backward.
    bytes =
        blocks * in_flight * checkpointed_layer_bytes(s, in.micro_batch, in.precision) + (blocks > 0 ? full_layer : 0);
  } else {
    bytes = blocks * in_flight * full_layer;
  }
  // The last stage runs each micro-batch's backward right after its forward:
  // one micro-batch of output-layer activations.
  if (stage == l.pp - 1) bytes += output_layer_activation_bytes(s, in.micro_batch, l.tp, in.precision);
  return bytes;
}

}  // namespace plan
}  // namespace meshtrain
