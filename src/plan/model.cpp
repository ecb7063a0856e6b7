#include "meshtrain/plan.h"

#include <algorithm>
#include <climits>
#include <map>
#include <mutex>
#include <tuple>
#include <utility>

#include "plan/units.h"
#include "meshtrain/pp.h"
#include "meshtrain/util.h"

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

std::string model_kind_name(ModelKind kind) {
  return kind == ModelKind::kGpt ? "gpt" : kind == ModelKind::kGpt2 ? "gpt2" : "llama";
}

int64_t kv_heads_of(const DecoderShape& s) { return s.kv_heads > 0 ? s.kv_heads : s.heads; }

int64_t ffn_hidden_of(const DecoderShape& s) {
  if (s.ffn_hidden > 0) return s.ffn_hidden;
  if (s.kind != ModelKind::kLlama) return 4 * s.hidden;
  return (2 * (4 * s.hidden) / 3 + 31) / 32 * 32;  // Meta's SwiGLU size, as models::ffn_hidden
}

int64_t max_positions_of(const DecoderShape& s) { return s.max_positions > 0 ? s.max_positions : s.seq_len; }

int64_t embedding_rows(const DecoderShape& s) {
  return s.kind == ModelKind::kGpt2 ? (s.vocab + 127) / 128 * 128 : s.vocab;
}

void check_shape(const DecoderShape& s) {
  MESHTRAIN_CHECK(s.layers >= 1 && s.hidden >= 1 && s.heads >= 1,
                  "the model's shape needs --layers, --hidden and --heads >= 1");
  MESHTRAIN_CHECK(s.hidden % s.heads == 0, "--hidden ", s.hidden, " is not a multiple of --heads ", s.heads,
                  "; choose --heads among the divisors of ", s.hidden, ": ", divisors_of(s.hidden));
  MESHTRAIN_CHECK(s.vocab >= 2 && s.seq_len >= 2, "--vocab ", s.vocab, " and --seq-len ", s.seq_len,
                  " must be at least 2 (meshtrain's models reject smaller ones)");
  MESHTRAIN_CHECK(s.max_positions == 0 || s.seq_len <= s.max_positions, "--seq-len ", s.seq_len,
                  " is longer than --max-positions ", s.max_positions, "; use --seq-len ", s.max_positions,
                  " or less, or more positions");
  MESHTRAIN_CHECK(s.kind == ModelKind::kLlama || s.kv_heads == 0 || s.kv_heads == s.heads, "--kv-heads ", s.kv_heads,
                  " (grouped-query attention) is for --model llama; ", model_kind_name(s.kind),
                  " has one key/value head per query head: drop --kv-heads or use --model llama");
  if (s.kind != ModelKind::kLlama) return;
  MESHTRAIN_CHECK(s.heads % kv_heads_of(s) == 0, "--kv-heads ", kv_heads_of(s), " must divide --heads ", s.heads,
                  " (each key/value head serves heads / kv-heads query heads); choose one of ", divisors_of(s.heads));
  MESHTRAIN_CHECK((s.hidden / s.heads) % 2 == 0, "rotary embeddings need an even head dimension; --hidden ", s.hidden,
                  " / --heads ", s.heads, " = ", s.hidden / s.heads, "; choose --heads so that the quotient is even");
}

std::string layout_problem(const DecoderShape& s, const Layout& l) {
  if (l.dp < 1 || l.pp < 1 || l.tp < 1 || l.cp < 1) return "dp, pp, tp and cp must be >= 1";
  if (s.seq_len % (2 * l.cp) != 0)
    return str_cat("cp ", l.cp, " cuts each sequence into ", 2 * l.cp, " chunks and does not divide --seq-len ",
                   s.seq_len, "; choose a --seq-len divisible by ", 2 * l.cp);
  if (l.zero < 0 || l.zero > 3) return str_cat("ZeRO stage ", l.zero, " does not exist; use 0, 1, 2 or 3");
  // What tp splits (models::validate): query heads, key/value heads, the MLP's inner size, the embedding's rows.
  const std::string rows = embedding_rows(s) == s.vocab ? "--vocab " : "the padded vocabulary ";
  const std::pair<std::string, int64_t> split[] = {{"--heads ", s.heads},
                                                   {"--kv-heads ", kv_heads_of(s)},
                                                   {"the MLP's inner size (--ffn-hidden) ", ffn_hidden_of(s)},
                                                   {rows, embedding_rows(s)}};
  for (const auto& [what, n] : split)
    if (n % l.tp != 0 && !(s.experts > 0 && what.rfind("the MLP", 0) == 0)) return str_cat("tp ", l.tp, " does not divide ", what, n, "; choose tp in ", divisors_of(n));
  if (l.ep < 1 || (l.ep > 1 && (s.experts % l.ep != 0 || l.replicas() % l.ep != 0)))
    return str_cat("ep ", l.ep, " must divide --experts ", s.experts, " and dp x cp = ", l.replicas());
  if (l.pp > num_pieces(s))
    return str_cat("pp ", l.pp, " is more than the ", num_pieces(s), " pieces of the model (embedding, ", s.layers,
                   " blocks, head); choose pp <= ", num_pieces(s));
  return "";
}

int64_t parameter_count(const DecoderShape& s) {
  int64_t n = 0;
  for (int64_t piece = 0; piece < num_pieces(s); ++piece) n += piece_parameter_count(s, 1, piece);
  return n;
}

namespace {

// One block's MLP per tp rank: dense (cut over tp), or the router and
// `computed` experts (whole on every tp rank).
int64_t mlp_parameter_count(const DecoderShape& s, int tp, int64_t computed) {
  const int64_t h = s.hidden, f = ffn_hidden_of(s);
  const bool llama = s.kind == ModelKind::kLlama;
  if (s.experts > 0) return s.experts * h + computed * (llama ? 3 : 2) * h * f;
  if (llama) return 3 * f * h / tp;                // gate, up column-, down row-parallel
  return (f * h / tp + f / tp) + (f * h / tp + h);  // fc1 column-, fc2 row-parallel (bias replicated)
}

}  // namespace

int64_t block_parameter_count(const DecoderShape& s, int tp) {
  const int64_t h = s.hidden;
  if (s.kind == ModelKind::kLlama) {
    const int64_t kv = kv_heads_of(s) * (h / s.heads);  // rows of k and of v
    const int64_t norms = 2 * h;                         // RMSNorm: a weight, no bias
    const int64_t attention = (h * h + 2 * kv * h) / tp + h * h / tp;  // q, k, v column-, o row-parallel
    return norms + attention + mlp_parameter_count(s, tp, s.experts);
  }
  const int64_t layer_norms = 2 * 2 * h;
  const int64_t qkv = 3 * (h * h / tp + h / tp);  // column-parallel: weight and bias split
  const int64_t proj = h * h / tp + h;            // row-parallel: bias replicated
  return layer_norms + qkv + proj + mlp_parameter_count(s, tp, s.experts);
}

int64_t expert_parameter_count(const DecoderShape& s) {
  return s.experts * (s.kind == ModelKind::kLlama ? 3 : 2) * s.hidden * ffn_hidden_of(s);
}

int64_t block_active_parameter_count(const DecoderShape& s, int tp) {
  if (s.experts == 0) return block_parameter_count(s, tp);
  return block_parameter_count(s, tp) - mlp_parameter_count(s, tp, s.experts) + mlp_parameter_count(s, tp, s.top_k);
}

int64_t stage_expert_parameter_count(const DecoderShape& s, const Layout& l, int stage) {
  if (l.ep <= 1) return 0;
  return blocks_on_stage(s, l.pp, stage) * expert_parameter_count(s) / l.ep;
}

int64_t stage_replicated_parameter_count(const DecoderShape& s, const Layout& l, int stage) {
  const int64_t held_apart = l.ep > 1 ? blocks_on_stage(s, l.pp, stage) * expert_parameter_count(s) : 0;
  return stage_parameter_count(s, l.pp, l.tp, stage) - held_apart;
}

int64_t num_pieces(const DecoderShape& s) { return s.layers + 2; }

int64_t piece_parameter_count(const DecoderShape& s, int tp, int64_t piece) {
  const int64_t h = s.hidden, rows = embedding_rows(s);
  const bool llama = s.kind == ModelKind::kLlama;
  if (piece == 0) return rows / tp * h + (llama ? 0 : max_positions_of(s) * h);  // rotary: no position table
  if (piece <= s.layers) return block_parameter_count(s, tp);
  const int64_t norm = llama ? h : 2 * h;  // RMSNorm: weight; LayerNorm: weight and bias
  return norm + (s.tie_embeddings ? 0 : rows / tp * h);
}

std::vector<int64_t> piece_costs(const DecoderShape& s) {
  std::vector<int64_t> costs;
  for (int64_t i = 0; i < num_pieces(s); ++i) costs.push_back(piece_parameter_count(s, 1, i));
  if (s.tie_embeddings) costs.back() += embedding_rows(s) * s.hidden;
  return costs;
}

// The stages are cut exactly as the trainer cuts them (pp::partition_balanced
// over the same piece costs): a stage that differed would make every
// per-stage estimate wrong.
const std::vector<int64_t>& stage_bounds(const DecoderShape& s, int pp) {
  MESHTRAIN_CHECK(pp >= 1 && pp <= num_pieces(s), "pp ", pp, " is more than the ", num_pieces(s),
                  " pieces of the model (embedding, ", s.layers, " blocks, head); choose pp <= ", num_pieces(s));
  // The planner asks for the same few partitions for every layout and cluster
  // size it tries: remember them (the dynamic program is O(pp * pieces^2)).
  // Entries are never erased, so the references handed out stay valid.
  using Key = std::tuple<int, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, bool, int, int64_t>;
  static std::mutex mutex;
  static std::map<Key, std::vector<int64_t>> cache;
  const Key key{static_cast<int>(s.kind), s.layers,    s.hidden,           s.heads,          kv_heads_of(s),
                ffn_hidden_of(s),         s.vocab,     max_positions_of(s), s.tie_embeddings, pp,
                s.experts};
  std::lock_guard<std::mutex> lock(mutex);
  auto it = cache.find(key);
  if (it == cache.end()) it = cache.emplace(key, pp::partition_balanced(piece_costs(s), pp)).first;
  return it->second;
}

int64_t blocks_on_stage(const DecoderShape& s, int pp, int stage) {
  const std::vector<int64_t>& b = stage_bounds(s, pp);
  // Blocks are pieces 1..layers.
  const int64_t first = std::max<int64_t>(b[stage], 1), last = std::min<int64_t>(b[stage + 1], s.layers + 1);
  return std::max<int64_t>(0, last - first);
}

int64_t stage_parameter_count(const DecoderShape& s, int pp, int tp, int stage) {
  const std::vector<int64_t>& b = stage_bounds(s, pp);
  int64_t n = 0;
  for (int64_t piece = b[stage]; piece < b[stage + 1]; ++piece) n += piece_parameter_count(s, tp, piece);
  return n;
}

int64_t largest_unit_parameter_count(const DecoderShape& s, int pp, int tp, int stage) {
  const std::vector<int64_t>& b = stage_bounds(s, pp);
  int64_t unit = 0;
  for (int64_t piece = b[stage]; piece < b[stage + 1]; ++piece)
    unit = std::max(unit, piece_parameter_count(s, tp, piece));
  return unit;
}

int64_t tied_weight_copy_count(const DecoderShape& s, int pp, int tp, int stage) {
  return s.tie_embeddings && pp > 1 && stage == pp - 1 ? embedding_rows(s) / tp * s.hidden : 0;
}

TensorShape largest_tensor(const DecoderShape& s) {
  const bool llama = s.kind == ModelKind::kLlama;
  const TensorShape candidates[] = {
      {"embedding", embedding_rows(s), s.hidden},
      {llama ? "MLP gate weight" : "MLP fc1 weight", ffn_hidden_of(s), s.hidden},
      {"position embedding", llama ? 0 : max_positions_of(s), s.hidden}};
  TensorShape largest = candidates[0];
  for (const TensorShape& t : candidates)
    if (t.numel() > largest.numel()) largest = t;
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

ModelStateBytes predict_rank_state_bytes(const DecoderShape& shape, const Layout& layout, int stage, int tp_rank,
                                         int dp_rank, Precision precision) {
  check_shape(shape);
  const std::string problem = layout_problem(shape, layout);
  MESHTRAIN_CHECK(problem.empty(), problem);
  MESHTRAIN_CHECK(stage >= 0 && stage < layout.pp, "stage ", stage, " is outside [0, ", layout.pp, ")");
  // tp splits every split tensor evenly (tp divides heads and vocab), so all
  // tp ranks of a stage hold the same number of parameters.
  MESHTRAIN_CHECK(tp_rank >= 0 && tp_rank < layout.tp, "tp_rank ", tp_rank, " is outside [0, ", layout.tp, ")");
  const int64_t psi = stage_replicated_parameter_count(shape, layout, stage);
  const StateBytesPerParam bytes = state_bytes_per_param(precision, OptimizerKind::kAdam, false);
  ModelStateBytes m = zero_model_state(psi, bytes, layout.zero, layout.dp, dp_rank);
  // The experts' replicas: dp_rank / ep is this rank's place among them.
  const ModelStateBytes held_apart = zero_model_state(stage_expert_parameter_count(shape, layout, stage), bytes,
                                                      std::min(layout.zero, 2), layout.expert_replicas(),
                                                      dp_rank / layout.ep);
  m.parameters += held_apart.parameters;
  m.gradients += held_apart.gradients;
  m.optimizer += held_apart.optimizer;
  return m;
}

}  // namespace plan
}  // namespace meshtrain
