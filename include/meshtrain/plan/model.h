#pragma once
// What the planner knows about a model: one of meshtrain's decoders
// (models/models.h: gpt, gpt2, llama), counted parameter by parameter, how a
// layout cuts it, and the ZeRO paper's model-state arithmetic. Pure
// functions, no libtorch (tests check the counts against models::parameter_count).
//
//   state bytes per parameter = parameters + gradients + optimizer (2 + 2 + K
//   in the ZeRO paper's notation; K = 12 for mixed-precision Adam)

#include <cstdint>
#include <string>
#include <vector>

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

}  // namespace plan
}  // namespace meshtrain
