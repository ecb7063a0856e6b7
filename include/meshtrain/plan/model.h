#pragma once
// What the planner knows about a model: meshtrain's GPT (models/models.h),
// counted parameter by parameter, how a layout cuts it, and the ZeRO paper's
// model-state arithmetic. Pure functions, no libtorch.
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

// The shape of meshtrain's GPT (models::ModelConfig with kind "gpt").
struct GptShape {
  int64_t layers = 0;
  int64_t hidden = 0;
  int64_t heads = 0;
  int64_t vocab = 0;
  int64_t seq_len = 0;
  bool tie_embeddings = true;  // the LM head reuses the token embedding
};

// A layout of world_size = dp * pp * tp ranks, with ZeRO stage `zero` (0 = DDP)
// on the data axis. Ranks follow the grid arange(world).view(dp, pp, tp): tp is
// the innermost axis, so a tp group is tp consecutive ranks.
struct Layout {
  int dp = 1, pp = 1, tp = 1, zero = 0;
};

// Why meshtrain cannot cut `shape` this way (tp must divide heads and the
// vocabulary, pp at most the number of pieces, zero in 0..3), or "" when it can.
std::string layout_problem(const GptShape& shape, const Layout& layout);

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

// Rejects shapes meshtrain's GPT cannot build (heads not dividing hidden, ...).
void check_gpt_shape(const GptShape& shape);

// meshtrain's GPT, parameter by parameter (models::parameter_count):
//   token embedding V*H + position embedding T*H
//   + layers * (2 LayerNorms 2*2H + q, k, v, proj 4*(H*H + H)
//               + fc1 (H*4H + 4H) + fc2 (4H*H + H))
//   + final LayerNorm 2H + (untied head: V*H, no bias)
int64_t gpt_parameter_count(const GptShape& shape);

// Parameters of one block held by one tp rank (Megatron's split, tp/layers.h):
// q, k, v and fc1 are column-parallel (weight and bias divided by tp); proj and
// fc2 are row-parallel (weight divided, bias replicated); LayerNorms replicated.
int64_t block_parameter_count(int64_t hidden, int tp);

// The GPT as meshtrain's pipeline cuts it (models::num_pieces): piece 0 the
// embeddings, pieces 1..layers the blocks, piece layers + 1 the final
// LayerNorm and LM head.
int64_t num_pieces(const GptShape& shape);

// Parameters of piece `piece` held by one tp rank: the embeddings split the
// vocabulary and replicate the positions; the head holds its LayerNorm and,
// when untied, a [V/tp, H] weight (a tied head uses the embedding's weight).
int64_t piece_parameter_count(const GptShape& shape, int tp, int64_t piece);

// What meshtrain's trainer balances its stages by (engine_mesh.cpp,
// piece_costs): each piece's full parameter count, a tied head counted with
// the V*H weight it multiplies by.
std::vector<int64_t> piece_costs(const GptShape& shape);

// The pieces of each of pp stages: pp + 1 boundaries, stage s holds pieces
// [bounds[s], bounds[s+1]). The trainer's own partition (pp::partition_balanced).
const std::vector<int64_t>& stage_bounds(const GptShape& shape, int pp);

// Blocks (transformer layers) on pipeline stage `stage` of `pp`.
int64_t blocks_on_stage(const GptShape& shape, int pp, int stage);

// Parameters one tp rank of pipeline stage `stage` holds: its pieces'.
int64_t stage_parameter_count(const GptShape& shape, int pp, int tp, int stage);

// Parameters of the largest unit ZeRO-3 gathers at once on this stage (one
// piece: a block, the embeddings or the head), per tp rank.
int64_t largest_unit_parameter_count(const GptShape& shape, int pp, int tp, int stage);

// Values of the embedding weight the last stage receives every step when the
// head is tied to an embedding on another stage (Note [Tied embeddings across
// pipeline stages], engine_mesh.cpp): a [V/tp, H] copy and its gradient, held
// as buffers, not as parameters. 0 elsewhere.
int64_t tied_weight_copy_count(const GptShape& shape, int pp, int tp, int stage);

// The model's largest single tensor (the token embedding, or fc1 when 4H > V).
struct TensorShape {
  std::string name;
  int64_t rows = 0, cols = 0;
  int64_t numel() const { return rows * cols; }
};
TensorShape largest_tensor(const GptShape& shape);

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
// GPT trained with Adam in `layout` (fp32: 4 + 4 + 8; bf16-mixed: 2 + 2 + 12), for comparison with what meshtrain
// measures (train::StateBytes). Assumes ZeRO shards the stage's parameters as
// one flat buffer; meshtrain shards bucket by bucket, so a shard may differ by
// up to one element per bucket (x 4 or 8 bytes) — calibrate against measurements.
ModelStateBytes predict_rank_state_bytes(const GptShape& shape, const Layout& layout, int stage, int tp_rank,
                                         int dp_rank = 0, Precision precision = Precision::kFp32);

}  // namespace plan
}  // namespace meshtrain
