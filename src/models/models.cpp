#include "meshtrain/models.h"

#include <ATen/ATen.h>

#include <cmath>
#include <limits>
#include <optional>

#include "meshtrain/util.h"

namespace meshtrain {
namespace models {

namespace {

InitSpec torch_linear_init(int64_t in) {  // torch.nn.Linear's default range
  const double bound = 1.0 / std::sqrt(static_cast<double>(in));
  return InitSpec::uniform(-bound, bound);
}

std::string divisors(int64_t n) {
  std::string out;
  for (int64_t d = 1; d <= n && d <= 64; ++d)
    if (n % d == 0) out += (out.empty() ? "" : ", ") + std::to_string(d);
  return out;
}

void check_tp(const ModelConfig& c, int t, bool sequence_parallel) {
  if (t == 1) return;
  if (c.kind == "mlp") {
    MESHTRAIN_CHECK(!sequence_parallel, "--sequence-parallel splits a sequence; the MLP has none (use it with a "
                    "language model: --model gpt, gpt2 or llama)");
    MESHTRAIN_CHECK(c.hidden % t == 0, "tp ", t, " does not divide the MLP's --hidden ", c.hidden,
                    " (the hidden features are split over tp); choose tp in {", divisors(c.hidden), "}");
    return;
  }
  MESHTRAIN_CHECK(c.heads % t == 0, "tp ", t, " does not divide --heads ", c.heads, " (attention heads are split over tp); choose tp in {", divisors(c.heads), "}");
  MESHTRAIN_CHECK(kv_heads(c) % t == 0, "tp ", t, " does not divide --kv-heads ", kv_heads(c),
                  " (key/value heads are split over tp, each rank keeping the ones its query heads read); choose tp "
                  "in {", divisors(kv_heads(c)), "}, or more --kv-heads");
  MESHTRAIN_CHECK(c.experts == 0 || !sequence_parallel, "--experts with --sequence-parallel: the MoE layers run "
                  "whole on every tp rank (the experts are not cut over tp), so their tokens cannot be split along "
                  "the sequence; drop --sequence-parallel or --experts");
  MESHTRAIN_CHECK(c.experts > 0 || ffn_hidden(c) % t == 0, "tp ", t, " does not divide the MLP's inner size ", ffn_hidden(c),
                  " (--ffn-hidden, split over tp); choose tp in {", divisors(ffn_hidden(c)), "} or another --ffn-hidden");
  const int64_t rows = padded_vocab(c);
  const std::string vocabulary = rows == c.vocab ? str_cat("--vocab ", c.vocab)
                                                 : str_cat("the ", rows, " rows of --vocab ", c.vocab, " padded");
  MESHTRAIN_CHECK(rows % t == 0, "tp ", t, " does not divide ", vocabulary, " (the vocabulary is split over tp); "
                  "choose tp in {", divisors(rows), "} or a vocabulary divisible by ", t);
  MESHTRAIN_CHECK(!sequence_parallel || c.seq_len % t == 0, "--sequence-parallel splits the sequence over tp: tp ", t,
                  " does not divide --seq-len ", c.seq_len, "; choose tp in {", divisors(c.seq_len), "}");
}

void check_language_model(const ModelConfig& c) {
  MESHTRAIN_CHECK(c.hidden >= 1 && c.heads >= 1 && c.hidden % c.heads == 0, "--hidden ", c.hidden,
                  " must be a positive multiple of --heads ", c.heads);
  MESHTRAIN_CHECK(c.vocab >= 2 && c.seq_len >= 2, "--vocab and --seq-len must be at least 2");
  MESHTRAIN_CHECK(c.max_positions == 0 || c.seq_len <= c.max_positions, "--seq-len ", c.seq_len,
                  " is longer than the model's ", c.max_positions, " positions; use --seq-len ", c.max_positions,
                  " or less");
  MESHTRAIN_CHECK(c.ffn_hidden >= 0 && c.kv_heads >= 0, "--ffn-hidden and --kv-heads must be positive (0: default)");
  MESHTRAIN_CHECK(c.norm_eps > 0, "the norm epsilon must be positive; got ", c.norm_eps);
  if (c.kind != "llama") {
    MESHTRAIN_CHECK(c.kv_heads == 0 || c.kv_heads == c.heads, "--kv-heads ", c.kv_heads, " (grouped-query "
                    "attention) is for --model llama; ", c.kind, " has one key/value head per query head");
    return;
  }
  MESHTRAIN_CHECK(c.heads % kv_heads(c) == 0, "--kv-heads ", kv_heads(c), " must divide --heads ", c.heads,
                  " (each key/value head serves heads / kv-heads query heads); choose one of {", divisors(c.heads), "}");
  MESHTRAIN_CHECK((c.hidden / c.heads) % 2 == 0, "rotary embeddings need an even head dimension; --hidden ",
                  c.hidden, " / --heads ", c.heads, " = ", c.hidden / c.heads);
  MESHTRAIN_CHECK(c.rope_theta > 0, "--rope-theta ", c.rope_theta, " must be positive (Llama 2: 10000, Llama 3: 500000)");
}

void check_experts(const ModelConfig& c) {
  MESHTRAIN_CHECK(c.experts >= 0, "--experts ", c.experts, " must be 0 (dense MLPs) or the number of experts");
  if (c.experts == 0) return;
  MESHTRAIN_CHECK(is_language_model(c), "--experts makes the blocks' MLPs mixtures of experts; --model mlp has no "
                  "blocks (use gpt, gpt2 or llama)");
  MESHTRAIN_CHECK(c.top_k >= 1 && c.top_k <= c.experts, "--top-k ", c.top_k, " routes each token to that many of "
                  "--experts ", c.experts, "; choose --top-k between 1 and ", c.experts);
  MESHTRAIN_CHECK(c.capacity_factor >= 0, "--capacity-factor ", c.capacity_factor, " must be >= 0 (0: dropless; cf "
                  "> 0: each expert computes at most cf x tokens x top-k / experts routes)");
  MESHTRAIN_CHECK(c.aux_loss_coef >= 0, "--aux-loss-coef ", c.aux_loss_coef, " must be >= 0 (0: no balance loss)");
}

void check_config(const ModelConfig& c) {
  MESHTRAIN_CHECK(c.kind == "gpt" || c.kind == "gpt2" || c.kind == "llama" || c.kind == "mlp", "unknown model '",
                  c.kind, "'; use gpt, gpt2, llama or mlp");
  MESHTRAIN_CHECK(c.layers >= 1, "--layers ", c.layers, " must be at least 1");
  check_experts(c);
  if (is_language_model(c)) return check_language_model(c);
  MESHTRAIN_CHECK(c.features >= 1 && c.hidden >= 1 && c.classes >= 2, "mlp sizes must be positive");
}

}  // namespace

void validate(const ModelConfig& c, int tp_size, bool sequence_parallel) {
  check_config(c);
  check_tp(c, tp_size, sequence_parallel);
}

int64_t num_pieces(const ModelConfig& c) { return is_language_model(c) ? c.layers + 2 : c.layers; }

bool is_language_model(const ModelConfig& c) { return c.kind != "mlp"; }

double training_flops_per_token(const ModelConfig& c) {
  if (!is_language_model(c)) return 6.0 * static_cast<double>(parameter_count(c));
  const int64_t positions = c.kind == "llama" ? 0 : max_positions(c) * c.hidden;
  const double weights = static_cast<double>(active_parameter_count(c) - positions);
  return 6.0 * weights + 12.0 * static_cast<double>(c.layers) * static_cast<double>(c.hidden) * c.seq_len;
}

int64_t padded_vocab(const ModelConfig& c) { return c.kind == "gpt2" ? (c.vocab + 127) / 128 * 128 : c.vocab; }

int64_t kv_heads(const ModelConfig& c) { return c.kv_heads > 0 ? c.kv_heads : c.heads; }

int64_t max_positions(const ModelConfig& c) { return c.max_positions > 0 ? c.max_positions : c.seq_len; }

int64_t ffn_hidden(const ModelConfig& c) {
  if (c.ffn_hidden > 0) return c.ffn_hidden;
  if (c.kind != "llama") return 4 * c.hidden;
  const int64_t two_thirds = 2 * (4 * c.hidden) / 3;  // Meta's SwiGLU size, rounded up to a multiple of 32 (llama2.c's multiple_of)
  return (two_thirds + 31) / 32 * 32;
}

MlpLayerImpl::MlpLayerImpl(int64_t in, int64_t out, bool relu_after, uint64_t seed, const std::string& name)
    : torch::nn::LinearImpl(torch::nn::LinearOptions(in, out)), relu(relu_after) {
  at::NoGradGuard no_grad;
  weight.copy_(init_full(seed, name + ".weight", torch_linear_init(in), {out, in}));
  bias.copy_(init_full(seed, name + ".bias", torch_linear_init(in), {out}));
}

at::Tensor MlpLayerImpl::forward(const at::Tensor& x) {
  at::Tensor y = torch::nn::LinearImpl::forward(x);
  return relu ? at::relu(y) : y;
}

std::map<std::string, std::string> tp_plan(const ModelConfig& c, torch::nn::Module& stage, int tp_size,
                                           bool sequence_parallel) {
  validate(c, tp_size, sequence_parallel);
  const std::string colwise = "colwise", rowwise = "rowwise", sequence = "sequence_parallel";
  std::map<std::string, std::string> plan;
  for (const auto& item : stage.named_modules("", /*include_self=*/false)) {
    const std::string& path = item.key();
    const std::string name = path.substr(path.rfind('.') + 1);
    if (c.kind == "mlp") {
      // Pairs (2k, 2k + 1): Megatron's MLP, one all-reduce per pair each way; an odd last layer stays whole.
      if (path.rfind("layers.", 0) != 0 || name == "layers") continue;
      const int64_t i = std::stoll(name);
      if (i % 2 == 0 && i + 1 < c.layers) plan[path] = colwise;
      if (i % 2 == 1) plan[path] = rowwise;
    } else if (name == "q" || name == "k" || name == "v" || name == "fc1" || name == "gate" || name == "up" ||
               path == "head.out") {
      plan[path] = colwise;
    } else if (name == "proj" || name == "fc2" || name == "o" || name == "down") {
      plan[path] = rowwise;
    } else if (path == "embed.tok") {
      plan[path] = "vocab_parallel";
    } else if (sequence_parallel &&
               (item.value()->as<torch::nn::LayerNormImpl>() || item.value()->as<nn::RMSNormImpl>())) {
      plan[path] = sequence;
    } else if (sequence_parallel && path == "embed" && item.value()->as<TokenEmbeddingImpl>()->pos.defined()) {
      plan["embed.pos"] = sequence;  // the rows of the rank's part of the sequence (TokenEmbeddingImpl::forward)
    }
  }
  return plan;
}

namespace {

// Piece i of a language model: the embedding, a block, or the head (tied to
// `embedding_weight` when that is on this stage).
void append_decoder_piece(StageImpl& stage, const ModelConfig& c, int64_t i, const BuildContext& ctx,
                          at::Tensor& embedding_weight) {
  if (i == 0) {
    TokenEmbedding e(c);
    embedding_weight = e->tok->weight;
    stage.append("", "embed", e);
  } else if (i == num_pieces(c) - 1) {
    stage.append("", "head", LmHead(c, ctx, c.tie_embeddings ? embedding_weight : at::Tensor()));
  } else if (c.kind == "llama") {
    LlamaBlock block(c, i - 1);
    stage.append("blocks", std::to_string(i - 1), block);
  } else {
    GptBlock block(c, i - 1);
    stage.append("blocks", std::to_string(i - 1), block);
  }
}

// --init-from: every parameter of the stage takes its value from `weights`
// (a head's copy of a tied embedding from the embedding's).
void load_values(StageImpl& stage, const ModelConfig& c, const std::map<std::string, at::Tensor>& weights) {
  at::NoGradGuard no_grad;
  for (auto& p : stage.named_parameters()) {
    const std::string name = c.tie_embeddings && p.key() == "head.out.weight" ? "embed.tok.weight" : p.key();
    const auto it = weights.find(name);
    MESHTRAIN_CHECK(it != weights.end(), "the weights to start from have no '", name, "', which the ", c.kind,
                    " model needs");
    MESHTRAIN_CHECK(it->second.sizes() == p.value().sizes(), "the weights' '", name, "' is ", it->second.sizes(),
                    " but the model's is ", p.value().sizes(), "; the shape flags must match the weights");
    p.value().copy_(it->second);
  }
}

}  // namespace

Stage build_stage(const ModelConfig& c, int64_t first, int64_t last, const BuildContext& ctx) {
  validate(c);
  const int64_t n = num_pieces(c);
  MESHTRAIN_CHECK(first >= 0 && first < last && last <= n, "build_stage: pieces [", first, ", ", last,
                  ") out of range for a model of ", n, " pieces");
  Stage stage;
  at::Tensor embedding_weight;
  // --init-from overwrites every parameter (load_values checks), so none is computed first.
  std::optional<SkipRandomInit> overwritten;
  if (ctx.weights) overwritten.emplace();
  for (int64_t i = first; i < last; ++i) {
    if (is_language_model(c)) {
      append_decoder_piece(*stage, c, i, ctx, embedding_weight);
      continue;
    }
    const int64_t in = i == 0 ? c.features : c.hidden;
    const int64_t out = i == c.layers - 1 ? c.classes : c.hidden;
    const std::string key = std::to_string(i);
    stage->append("layers", key, MlpLayer(in, out, /*relu=*/i != c.layers - 1, c.seed, "layers." + key));
  }
  overwritten.reset();
  if (ctx.weights) load_values(*stage, c, *ctx.weights);
  return stage;
}

at::Tensor predicted_logits(const ModelConfig& c, const at::Tensor& logits, int64_t first) {
  const int64_t padded = padded_vocab(c), local = logits.size(-1);
  if (padded == c.vocab) return logits;
  if (first == 0 && local == padded) return logits.narrow(-1, 0, c.vocab);
  // A slice of the rows (tensor parallelism's): the padded ones out of every softmax.
  if (first + local <= c.vocab) return logits;
  const at::Tensor padding = at::arange(first, first + local, at::kLong) >= c.vocab;
  return logits.masked_fill(padding, -std::numeric_limits<float>::infinity());
}

at::Tensor loss(const ModelConfig& c, const at::Tensor& output, const at::Tensor& targets) {
  if (c.kind == "mlp") return at::cross_entropy_loss(output, targets);
  const at::Tensor logits = predicted_logits(c, output);
  return at::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}), targets.reshape({-1}));
}

MoEOptions block_moe_options(const ModelConfig& c, int64_t index) {
  const bool llama = c.kind == "llama";
  return MoEOptions(c.hidden, ffn_hidden(c), c.experts, c.top_k)
      .capacity_factor(c.capacity_factor).aux_loss_coef(c.aux_loss_coef).swiglu(llama).gelu_tanh(c.kind == "gpt2")
      .seed(c.seed).name("blocks." + std::to_string(index) + ".moe");
}

namespace {

// One block's MLP: dense (GPT's with biases), or the router and E experts.
int64_t mlp_parameter_count(const ModelConfig& c, int64_t experts_computed) {
  const int64_t h = c.hidden, f = ffn_hidden(c), matrices = c.kind == "llama" ? 3 : 2;
  if (c.experts == 0) return matrices * h * f + (c.kind == "llama" ? 0 : f + h);
  return c.experts * h + experts_computed * matrices * h * f;
}

}  // namespace

int64_t active_parameter_count(const ModelConfig& c) {
  if (c.experts == 0) return parameter_count(c);
  return parameter_count(c) - c.layers * (mlp_parameter_count(c, c.experts) - mlp_parameter_count(c, c.top_k));
}

int64_t parameter_count(const ModelConfig& c) {
  if (c.kind == "mlp") {
    int64_t total = 0;
    for (int64_t i = 0; i < c.layers; ++i) {
      const int64_t in = i == 0 ? c.features : c.hidden, out = i == c.layers - 1 ? c.classes : c.hidden;
      total += in * out + out;
    }
    return total;
  }
  const int64_t h = c.hidden, rows = padded_vocab(c);
  const int64_t embeddings = rows * h * (c.tie_embeddings ? 1 : 2);
  if (c.kind == "llama") {
    const int64_t d = h / c.heads, attention = 2 * h * c.heads * d + 2 * h * kv_heads(c) * d;
    return embeddings + c.layers * (2 * h + attention + mlp_parameter_count(c, c.experts)) + h;
  }
  const int64_t block = 2 * 2 * h + 4 * (h * h + h) + mlp_parameter_count(c, c.experts);
  return embeddings + max_positions(c) * h + c.layers * block + 2 * h;
}

}  // namespace models
}  // namespace meshtrain
