#include "meshtrain/plan/model.h"

#include "meshtrain/pp/schedule.h"

#include <algorithm>
#include <climits>
#include <map>
#include <mutex>
#include <tuple>

#include "meshtrain/plan/units.h"
#include "meshtrain/pp/schedule.h"
#include "meshtrain/util/error.h"

namespace meshtrain {
namespace plan {

namespace {

// The divisors of n up to `limit`, for error messages ("choose tp in {1, 2, 4}").
std::string divisors_of(int64_t n, int64_t limit = 64) {
  std::string out;
  for (int64_t d = 1; d <= n && d <= limit; ++d)
    if (n % d == 0) out += (out.empty() ? "" : ", ") + std::to_string(d);
  return "{" + out + "}";
}

// Elements of shard `rank` when n elements are split over `parts` (util/shard.h's rule).
int64_t shard_of(int64_t n, int parts, int rank) { return n / parts + (rank < n % parts ? 1 : 0); }

}  // namespace

StateBytesPerParam state_bytes_per_param(Precision precision, OptimizerKind optimizer, bool momentum) {
  const int moments = optimizer == OptimizerKind::kAdam ? 8 : (momentum ? 4 : 0);
  if (precision == Precision::kFp32) return {4, 4, moments};
  return {2, 2, 4 + moments};  // + the fp32 master weights
}

int activation_bytes_per_value(Precision precision) { return precision == Precision::kFp32 ? 4 : 2; }

void check_gpt_shape(const GptShape& s) {
  MESHTRAIN_CHECK(s.layers >= 1 && s.hidden >= 1 && s.heads >= 1,
                  "the GPT shape needs --layers, --hidden and --heads >= 1");
  MESHTRAIN_CHECK(s.hidden % s.heads == 0, "--hidden ", s.hidden, " is not a multiple of --heads ", s.heads,
                  "; choose --heads among the divisors of ", s.hidden, ": ", divisors_of(s.hidden));
  MESHTRAIN_CHECK(s.vocab >= 2 && s.seq_len >= 2, "--vocab ", s.vocab, " and --seq-len ", s.seq_len,
                  " must be at least 2 (meshtrain's GPT rejects smaller ones)");
}

std::string layout_problem(const GptShape& s, const Layout& l) {
  if (l.dp < 1 || l.pp < 1 || l.tp < 1) return "dp, pp and tp must be >= 1";
  if (l.zero < 0 || l.zero > 3) return str_cat("ZeRO stage ", l.zero, " does not exist; use 0, 1, 2 or 3");
  if (s.heads % l.tp != 0)
    return str_cat("tp ", l.tp, " does not divide --heads ", s.heads, "; choose tp in ", divisors_of(s.heads));
  if (s.vocab % l.tp != 0)
    return str_cat("tp ", l.tp, " does not divide --vocab ", s.vocab,
                   " (the embedding is split by rows); choose tp in ", divisors_of(s.vocab));
  if (l.pp > num_pieces(s))
    return str_cat("pp ", l.pp, " is more than the ", num_pieces(s), " pieces of the GPT (embedding, ", s.layers,
                   " blocks, head); choose pp <= ", num_pieces(s));
  return "";
}

int64_t gpt_parameter_count(const GptShape& s) {
  const int64_t h = s.hidden;
  const int64_t embeddings = s.vocab * h + s.seq_len * h;
  const int64_t head = 2 * h + (s.tie_embeddings ? 0 : s.vocab * h);
  return embeddings + s.layers * block_parameter_count(h, 1) + head;
}

int64_t block_parameter_count(int64_t h, int tp) {
  const int64_t layer_norms = 2 * 2 * h;
  const int64_t qkv = 3 * (h * h / tp + h / tp);    // column-parallel: weight and bias split
  const int64_t proj = h * h / tp + h;              // row-parallel: bias replicated
  const int64_t fc1 = 4 * h * h / tp + 4 * h / tp;  // column-parallel
  const int64_t fc2 = 4 * h * h / tp + h;           // row-parallel
  return layer_norms + qkv + proj + fc1 + fc2;
}

int64_t num_pieces(const GptShape& s) { return s.layers + 2; }

int64_t piece_parameter_count(const GptShape& s, int tp, int64_t piece) {
  const int64_t h = s.hidden;
  if (piece == 0) return s.vocab / tp * h + s.seq_len * h;
  if (piece <= s.layers) return block_parameter_count(h, tp);
  return 2 * h + (s.tie_embeddings ? 0 : s.vocab / tp * h);
}

std::vector<int64_t> piece_costs(const GptShape& s) {
  std::vector<int64_t> costs;
  for (int64_t i = 0; i < num_pieces(s); ++i) costs.push_back(piece_parameter_count(s, 1, i));
  if (s.tie_embeddings) costs.back() += s.vocab * s.hidden;
  return costs;
}

// The stages are cut exactly as the trainer cuts them (pp::partition_balanced
// over the same piece costs): a stage that differed would make every
// per-stage estimate wrong.
const std::vector<int64_t>& stage_bounds(const GptShape& s, int pp) {
  MESHTRAIN_CHECK(pp >= 1 && pp <= num_pieces(s), "pp ", pp, " is more than the ", num_pieces(s),
                  " pieces of the GPT (embedding, ", s.layers, " blocks, head)");
  // The planner asks for the same few partitions for every layout and cluster
  // size it tries: remember them (the dynamic program is O(pp * pieces^2)).
  // Entries are never erased, so the references handed out stay valid.
  using Key = std::tuple<int64_t, int64_t, int64_t, int64_t, bool, int>;
  static std::mutex mutex;
  static std::map<Key, std::vector<int64_t>> cache;
  const Key key{s.layers, s.hidden, s.vocab, s.seq_len, s.tie_embeddings, pp};
  std::lock_guard<std::mutex> lock(mutex);
  auto it = cache.find(key);
  if (it == cache.end()) it = cache.emplace(key, pp::partition_balanced(piece_costs(s), pp)).first;
  return it->second;
}

int64_t blocks_on_stage(const GptShape& s, int pp, int stage) {
  const std::vector<int64_t>& b = stage_bounds(s, pp);
  // Blocks are pieces 1..layers.
  const int64_t first = std::max<int64_t>(b[stage], 1), last = std::min<int64_t>(b[stage + 1], s.layers + 1);
  return std::max<int64_t>(0, last - first);
}

int64_t stage_parameter_count(const GptShape& s, int pp, int tp, int stage) {
  const std::vector<int64_t>& b = stage_bounds(s, pp);
  int64_t n = 0;
  for (int64_t piece = b[stage]; piece < b[stage + 1]; ++piece) n += piece_parameter_count(s, tp, piece);
  return n;
}

int64_t largest_unit_parameter_count(const GptShape& s, int pp, int tp, int stage) {
  const std::vector<int64_t>& b = stage_bounds(s, pp);
  int64_t unit = 0;
  for (int64_t piece = b[stage]; piece < b[stage + 1]; ++piece)
    unit = std::max(unit, piece_parameter_count(s, tp, piece));
  return unit;
}

int64_t tied_weight_copy_count(const GptShape& s, int pp, int tp, int stage) {
  return s.tie_embeddings && pp > 1 && stage == pp - 1 ? s.vocab / tp * s.hidden : 0;
}

TensorShape largest_tensor(const GptShape& s) {
  const TensorShape embedding{"embedding", s.vocab, s.hidden};
  const TensorShape fc1{"MLP fc1 weight", 4 * s.hidden, s.hidden};
  const TensorShape position{"position embedding", s.seq_len, s.hidden};
  TensorShape largest = embedding;
  if (fc1.numel() > largest.numel()) largest = fc1;
  if (position.numel() > largest.numel()) largest = position;
  return largest;
}

ModelStateBytes zero_model_state(int64_t psi, const StateBytesPerParam& b, int zero, int dp_size, int dp_rank) {
  MESHTRAIN_CHECK(zero >= 0 && zero <= 3, "ZeRO stage ", zero, " does not exist; use 0, 1, 2 or 3");
  MESHTRAIN_CHECK(dp_size >= 1 && dp_rank >= 0 && dp_rank < dp_size, "dp_rank ", dp_rank, " is outside [0, ", dp_size,
                  ")");
  const int64_t shard = shard_of(psi, dp_size, dp_rank);
  ModelStateBytes m;
  m.parameters = b.parameters * (zero >= 3 ? shard : psi);
  m.gradients = b.gradients * (zero >= 2 ? shard : psi);
  m.optimizer = b.optimizer * (zero >= 1 ? shard : psi);
  if (zero >= 3 && b.parameters < 4) {
    // Mixed precision at stage 3 (zero::fully_shard, as PyTorch's FSDP): the
    // float32 shard is both the parameter and the master the optimizer steps,
    // its gradient float32; the same total as the paper's (2 + 2 + K).
    m.parameters = 4 * shard;
    m.gradients = 4 * shard;
    m.optimizer = (b.optimizer - 4) * shard;
  }
  return m;
}

ModelStateBytes predict_rank_state_bytes(const GptShape& shape, const Layout& layout, int stage, int tp_rank,
                                         int dp_rank, Precision precision) {
  check_gpt_shape(shape);
  const std::string problem = layout_problem(shape, layout);
  MESHTRAIN_CHECK(problem.empty(), problem);
  MESHTRAIN_CHECK(stage >= 0 && stage < layout.pp, "stage ", stage, " is outside [0, ", layout.pp, ")");
  // tp splits every split tensor evenly (tp divides heads and vocab), so all
  // tp ranks of a stage hold the same number of parameters.
  MESHTRAIN_CHECK(tp_rank >= 0 && tp_rank < layout.tp, "tp_rank ", tp_rank, " is outside [0, ", layout.tp, ")");
  const int64_t psi = stage_parameter_count(shape, layout.pp, layout.tp, stage);
  return zero_model_state(psi, state_bytes_per_param(precision, OptimizerKind::kAdam, false), layout.zero, layout.dp,
                          dp_rank);
}

}  // namespace plan
}  // namespace meshtrain
