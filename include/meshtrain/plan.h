#pragma once
// meshtrain/plan.h: the planner: model sizes, inputs, estimates, and the layouts that fit and run fastest.
// Part of the public API (meshtrain/meshtrain.h includes it); the sections below
// are in dependency order.

#include <cstdint>
#include <iosfwd>
#include <optional>
#include <string>
#include <vector>

// ===== model =====
// What the planner knows about a model: one of meshtrain's decoders
// (meshtrain/models.h: gpt, gpt2, llama), counted parameter by parameter, how a
// layout cuts it, and the ZeRO paper's model-state arithmetic. Pure
// functions, no libtorch (tests check the counts against models::parameter_count).
//
//   state bytes per parameter = parameters + gradients + optimizer (2 + 2 + K
//   in the ZeRO paper's notation; K = 12 for mixed-precision Adam)

namespace meshtrain {
namespace plan {

enum class Precision { kFp32, kBf16Mixed, kFp16Mixed };
enum class OptimizerKind { kAdam, kSgd };

// meshtrain's built-in decoders (models::ModelConfig::kind):
//   kGpt    token + position embeddings, LayerNorm blocks with biases, a GELU MLP
//   kGpt2   the same, with the embedding's rows padded to a multiple of 128
//   kLlama  RMSNorm, rotary positions, grouped-query attention, SwiGLU, no biases
enum class ModelKind { kGpt, kGpt2, kLlama };

// How attention keeps its activations for backward:
//   kEager  the softmax of the T x T scores (the trainer's --attention eager)
//   kFlash  memory-efficient (FlashAttention, Dao et al. 2022): the scores are
//           recomputed in backward from Q, K, V, the output and each row's
//           log-sum-exp; memory linear in T (--attention flash,
//           nn::flash_attention)
enum class Attention { kEager, kFlash };

// The shape of a decoder, as models::ModelConfig holds it. Zero fields take the
// model's defaults (kv_heads_of, ffn_hidden_of, max_positions_of).
struct DecoderShape {
  ModelKind kind = ModelKind::kGpt;
  int64_t layers = 0;
  int64_t hidden = 0;
  int64_t heads = 0;
  int64_t kv_heads = 0;       // llama's key/value heads (grouped-query attention); 0: heads
  int64_t ffn_hidden = 0;     // the MLP's inner size; 0: 4H (gpt, gpt2), 8/3 H rounded up to 32 (llama)
  int64_t vocab = 0;          // tokens predicted
  int64_t seq_len = 0;        // tokens per sample
  int64_t max_positions = 0;  // gpt, gpt2: rows of the position table; 0: seq_len
  bool tie_embeddings = true;  // the LM head reuses the token embedding (meshtrain's default for gpt, gpt2)
  // Mixture of experts (the trainer's --experts, --top-k): every block's MLP
  // is `experts` MLPs of ffn_hidden and a router [experts, H]; each token is
  // computed by top_k of them. 0: dense.
  int64_t experts = 0;
  int64_t top_k = 2;
};

// "gpt", "gpt2", "llama" (the trainer's --model).
std::string model_kind_name(ModelKind kind);

// The defaults applied, exactly as models::kv_heads, ffn_hidden, max_positions
// and padded_vocab (embedding_rows: gpt2 pads to a multiple of 128).
int64_t kv_heads_of(const DecoderShape& shape);
int64_t ffn_hidden_of(const DecoderShape& shape);
int64_t max_positions_of(const DecoderShape& shape);
int64_t embedding_rows(const DecoderShape& shape);

// A layout of world_size = dp * pp * tp ranks, with ZeRO stage `zero` (0 = DDP)
// on the data axis. Ranks follow the grid arange(world).view(dp, pp, tp): tp is
// the innermost axis, so a tp group is tp consecutive ranks.
struct Layout {
  int dp = 1, pp = 1, tp = 1, zero = 0;
  // Context parallelism: each sequence split over cp ranks (ring attention,
  // flash activations of seq_len / cp positions); ZeRO and the gradients'
  // reduction span dp x cp, the ranks that hold the same parameters.
  int cp = 1;
  // Expert parallelism (mixtures of experts): each block's experts split over
  // ep consecutive ranks of dp x cp, ZeRO 1/2 over their replicas (2 under
  // ZeRO-3); tokens sent to them by all-to-all.
  int ep = 1;
  // The ranks holding the same parameters, which ZeRO shards and the gradients reduce over.
  int replicas() const { return dp * cp; }
  // The ranks holding the same experts under expert parallelism.
  int expert_replicas() const { return replicas() / ep; }
};

// Why meshtrain cannot cut `shape` this way (tp must divide the heads, the
// key/value heads, the MLP's inner size and the embedding's rows, as
// models::validate checks; pp at most the number of pieces; zero in 0..3), or
// "" when it can.
std::string layout_problem(const DecoderShape& shape, const Layout& layout);

// Bytes each parameter costs, by kind of state.
struct StateBytesPerParam {
  int parameters = 4;
  int gradients = 4;
  int optimizer = 8;
  int total() const { return parameters + gradients + optimizer; }
};

// ZeRO paper §3.1: mixed precision keeps 16-bit weights and gradients (2 + 2)
// and K bytes of fp32 state: master weights 4, Adam's two moments 4 + 4 (K =
// 12); SGD keeps the master weights (K = 4), plus 4 with momentum. fp32 keeps
// no master copy: Adam 4 + 4 + 8, SGD 4 + 4 (+ 4 with momentum).
StateBytesPerParam state_bytes_per_param(Precision precision, OptimizerKind optimizer, bool momentum);

// Bytes of one activation value: 2 for the mixed precisions, 4 for fp32.
int activation_bytes_per_value(Precision precision);

// Rejects shapes meshtrain's models cannot build, as models::validate does
// (heads not dividing hidden, kv_heads not dividing heads, ...): a ConfigError
// naming the flag, the value and the choices.
void check_shape(const DecoderShape& shape);

// The whole model, parameter by parameter, exactly models::parameter_count
// (V the embedding's rows, F the MLP's inner size, P the positions):
//   gpt, gpt2  token embedding V*H + position embedding P*H
//              + layers * (2 LayerNorms 2*2H + q, k, v, proj 4*(H*H + H)
//                          + fc1 (H*F + F) + fc2 (F*H + H))
//              + final LayerNorm 2H + (untied head: V*H, no bias)
//   llama      token embedding V*H
//              + layers * (2 RMSNorms 2H + q, o 2*H*H + k, v 2*H*(K*H/A)
//                          + gate, up, down 3*H*F)          (no biases)
//              + final RMSNorm H + (untied head: V*H)
int64_t parameter_count(const DecoderShape& shape);

// Parameters of one block held by one tp rank (Megatron's split, tp::parallelize with
// models::tp_plan): q, k, v, fc1 (gate, up) column-parallel, weight and bias
// divided by tp; proj (o) and fc2 (down) row-parallel, weight divided, bias
// replicated; the norms replicated.
// With experts: the router and every expert's MLP, whole on every tp rank
// (models::MoE is not cut over tp).
int64_t block_parameter_count(const DecoderShape& shape, int tp);
// The weights of one block's experts (all of them; 0 for a dense block):
// experts x (3 H F (SwiGLU) or 2 H F (GELU, no biases)).
int64_t expert_parameter_count(const DecoderShape& shape);
// What one token computes with in a block: the block less the experts it skips.
int64_t block_active_parameter_count(const DecoderShape& shape, int tp);
// The experts' weights one rank of `stage` holds under expert parallelism:
// its blocks' experts / ep (0 when ep is 1: they are ordinary parameters then).
int64_t stage_expert_parameter_count(const DecoderShape& shape, const Layout& layout, int stage);
// The rest of the stage's parameters one tp rank holds, which ZeRO shards over
// dp x cp: all of them without expert parallelism.
int64_t stage_replicated_parameter_count(const DecoderShape& shape, const Layout& layout, int stage);

// The model as meshtrain's pipeline cuts it (models::num_pieces): piece 0 the
// embeddings, pieces 1..layers the blocks, piece layers + 1 the final norm
// and LM head.
int64_t num_pieces(const DecoderShape& shape);

// Parameters of piece `piece` held by one tp rank: the embeddings split the
// vocabulary and replicate the positions (gpt, gpt2); the head holds its norm
// and, when untied, a [V/tp, H] weight (a tied head uses the embedding's weight).
int64_t piece_parameter_count(const DecoderShape& shape, int tp, int64_t piece);

// What meshtrain's trainer balances its stages by (engine_mesh.cpp,
// piece_costs): each piece's full parameter count, a tied head counted with
// the V*H weight it multiplies by.
std::vector<int64_t> piece_costs(const DecoderShape& shape);

// The pieces of each of pp stages: pp + 1 boundaries, stage s holds pieces
// [bounds[s], bounds[s+1]). The trainer's own partition (pp::partition_balanced).
const std::vector<int64_t>& stage_bounds(const DecoderShape& shape, int pp);

// Blocks (transformer layers) on pipeline stage `stage` of `pp`.
int64_t blocks_on_stage(const DecoderShape& shape, int pp, int stage);

// Parameters one tp rank of pipeline stage `stage` holds: its pieces'.
int64_t stage_parameter_count(const DecoderShape& shape, int pp, int tp, int stage);

// Parameters of the largest unit ZeRO-3 gathers at once on this stage (one
// piece: a block, the embeddings or the head), per tp rank.
int64_t largest_unit_parameter_count(const DecoderShape& shape, int pp, int tp, int stage);

// Values of the embedding weight the last stage receives every step when the
// head is tied to an embedding on another stage (Note [Tied embeddings across
// pipeline stages], engine_mesh.cpp): a [V/tp, H] copy and its gradient, held
// as buffers, not as parameters. 0 elsewhere.
int64_t tied_weight_copy_count(const DecoderShape& shape, int pp, int tp, int stage);

// The model's largest single tensor (the token embedding, or an MLP matrix
// when F > V, or the position table).
struct TensorShape {
  std::string name;
  int64_t rows = 0, cols = 0;
  int64_t numel() const { return rows * cols; }
};
TensorShape largest_tensor(const DecoderShape& shape);

// Bytes of model state one rank holds.
struct ModelStateBytes {
  int64_t parameters = 0, gradients = 0, optimizer = 0;
  int64_t total() const { return parameters + gradients + optimizer; }
};

// ZeRO paper, Figure 1 / §5.1, for psi parameters replicated over dp_size ranks:
//   stage 0 (DDP)  (2 + 2 + K) psi
//   stage 1        (2 + 2) psi + K psi / N         optimizer state sharded
//   stage 2        2 psi + (2 + K) psi / N         + gradients
//   stage 3        (2 + 2 + K) psi / N             + parameters
//                  (mixed precision: the float32 shard is the master,
//                  counted 4 + 4 + (K - 4), the same total)
// A shard is psi / N elements, the first psi % N ranks one more (util/shard.h).
ModelStateBytes zero_model_state(int64_t psi, const StateBytesPerParam& bytes, int zero, int dp_size, int dp_rank = 0);

// Predicted model state (parameters, gradients, optimizer) of one rank of a
// decoder trained with Adam in `layout` (fp32: 4 + 4 + 8; bf16-mixed: 2 + 2 + 12), for comparison with what meshtrain
// measures (train::StateBytes). Assumes ZeRO shards the stage's parameters as
// one flat buffer; meshtrain shards bucket by bucket, so a shard may differ by
// up to one element per bucket (x 4 or 8 bytes) — calibrate against measurements.
ModelStateBytes predict_rank_state_bytes(const DecoderShape& shape, const Layout& layout, int stage, int tp_rank,
                                         int dp_rank = 0, Precision precision = Precision::kFp32);

// ===== input =====
// What `meshtrain plan` is asked: a model (the shape of one of meshtrain's
// decoders, or a bare parameter count), how it is trained (precision, optimizer, batch) and the
// cluster (devices, memory, nodes, links). Parsed from command-line flags,
// checked as a whole: every error names the flag, the value and the fix.

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

// ===== estimate =====
// Per-device estimates for one layout: memory (model state, activations,
// communication buffers), bytes communicated per step, and the time those
// bytes take on the links. Each formula is a small named function citing its
// source; estimate_layout puts them together, stage by stage.
//
// Notation: s sequence length, b micro-batch, h hidden, a heads, v vocabulary,
// t tp degree, n the size of the group a collective runs in.

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

// ===== planner =====
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
