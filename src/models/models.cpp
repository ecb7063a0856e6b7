#include "meshtrain/models/models.h"

#include <ATen/ATen.h>

#include <cmath>

#include "meshtrain/tp/ops.h"
#include "meshtrain/tp/parallelize.h"
#include "meshtrain/util/error.h"

namespace meshtrain {
namespace models {

namespace {

InitSpec torch_linear_init(int64_t in) {  // torch.nn.Linear's default range
  const double bound = 1.0 / std::sqrt(static_cast<double>(in));
  return InitSpec::uniform(-bound, bound);
}

torch::nn::LayerNorm layer_norm(int64_t h) {
  return torch::nn::LayerNorm(torch::nn::LayerNormOptions({h}));  // weight 1, bias 0: deterministic
}

}  // namespace

namespace {

void check_tp(const ModelConfig& c, int t, bool sequence_parallel) {
  if (t == 1) return;
  auto divisors = [](int64_t n) {
    std::string out;
    for (int64_t d = 1; d <= n && d <= 64; ++d)
      if (n % d == 0) out += (out.empty() ? "" : ", ") + std::to_string(d);
    return out;
  };
  if (c.kind == "mlp") {
    MESHTRAIN_CHECK(!sequence_parallel, "--sequence-parallel splits a sequence; the MLP has none (use it with --model gpt)");
    MESHTRAIN_CHECK(c.hidden % t == 0, "tp ", t, " does not divide the MLP's --hidden ", c.hidden,
                    " (the hidden features are split over tp); choose tp in {", divisors(c.hidden), "}");
    return;
  }
  MESHTRAIN_CHECK(c.heads % t == 0, "tp ", t, " does not divide --heads ", c.heads, " (attention heads are split over tp); choose tp in {", divisors(c.heads), "}");
  MESHTRAIN_CHECK(c.vocab % t == 0, "tp ", t, " does not divide --vocab ", c.vocab, " (the vocabulary is split over tp); choose tp in {", divisors(c.vocab), "} or a vocabulary divisible by ", t);
  MESHTRAIN_CHECK(!sequence_parallel || c.seq_len % t == 0, "--sequence-parallel splits the sequence over tp: tp ", t,
                  " does not divide --seq-len ", c.seq_len, "; choose tp in {", divisors(c.seq_len), "}");
}

void check_config(const ModelConfig& c) {
  MESHTRAIN_CHECK(c.kind == "gpt" || c.kind == "mlp", "unknown model '", c.kind, "'; use gpt or mlp");
  MESHTRAIN_CHECK(c.layers >= 1, "--layers ", c.layers, " must be at least 1");
  if (c.kind == "gpt") {
    MESHTRAIN_CHECK(c.hidden >= 1 && c.heads >= 1 && c.hidden % c.heads == 0, "--hidden ", c.hidden,
                    " must be a positive multiple of --heads ", c.heads);
    MESHTRAIN_CHECK(c.vocab >= 2 && c.seq_len >= 2, "--vocab and --seq-len must be at least 2");
  } else {
    MESHTRAIN_CHECK(c.features >= 1 && c.hidden >= 1 && c.classes >= 2, "mlp sizes must be positive");
  }
}

}  // namespace

void validate(const ModelConfig& c, int tp_size, bool sequence_parallel) {
  check_config(c);
  check_tp(c, tp_size, sequence_parallel);
}

int64_t num_pieces(const ModelConfig& c) { return is_language_model(c) ? c.layers + 2 : c.layers; }

bool is_language_model(const ModelConfig& c) { return c.kind != "mlp"; }

int64_t padded_vocab(const ModelConfig& c) { return c.kind == "gpt2" ? (c.vocab + 127) / 128 * 128 : c.vocab; }

int64_t kv_heads(const ModelConfig& c) { return c.kv_heads > 0 ? c.kv_heads : c.heads; }

int64_t ffn_hidden(const ModelConfig& c) {
  if (c.ffn_hidden > 0) return c.ffn_hidden;
  if (c.kind != "llama") return 4 * c.hidden;
  const int64_t two_thirds = 2 * (4 * c.hidden) / 3;  // Meta's SwiGLU size, rounded up to a multiple of 32 (llama2.c's multiple_of)
  return (two_thirds + 31) / 32 * 32;
}

namespace {

// A plain Linear whose values derive from seed + name (the layer's path), the
// same on every rank: tp::parallelize slices them.
torch::nn::Linear seeded_linear(int64_t in, int64_t out, bool bias, uint64_t seed, const std::string& name,
                                const InitSpec& weight_init, const InitSpec& bias_init = InitSpec::constant(0)) {
  torch::nn::Linear layer(torch::nn::LinearOptions(in, out).bias(bias));
  at::NoGradGuard no_grad;
  layer->weight.copy_(init_full(seed, name + ".weight", weight_init, {out, in}));
  if (bias) layer->bias.copy_(init_full(seed, name + ".bias", bias_init, {out}));
  return layer;
}

// The token embedding's values (the head tied to it starts from them too).
at::Tensor token_embedding_values(const ModelConfig& c) {
  return init_full(c.seed, "embed.tok.weight", InitSpec::normal(0, 0.02), {c.vocab, c.hidden});
}

}  // namespace

GptEmbeddingImpl::GptEmbeddingImpl(const ModelConfig& c, const BuildContext& context) : ctx(context) {
  tok = register_module("tok", torch::nn::Embedding(torch::nn::EmbeddingOptions(c.vocab, c.hidden)
                                                        ._weight(token_embedding_values(c))));
  pos = register_parameter("pos", init_full(c.seed, "embed.pos", InitSpec::normal(0, 0.01), {c.seq_len, c.hidden}));
}

at::Tensor GptEmbeddingImpl::forward(const at::Tensor& tokens) {
  MESHTRAIN_CHECK(tokens.dim() == 2 && tokens.size(1) <= pos.size(0), "GPT input must be [batch, seq <= ",
                  pos.size(0), "] token ids; got ", tokens.sizes());
  at::Tensor x = tok->forward(tokens);  // [B, T/tp, H] under sequence parallelism (tp::parallelize)
  if (ctx.sequence_parallel && tp::tp_size(ctx.tp) > 1) {
    // This rank holds positions [r*T/tp, (r+1)*T/tp) and adds those rows, so
    // each rank's gradient covers its rows only: copy_to_tp (before slicing)
    // sums them into the full gradient on every rank.
    const int64_t part = x.size(1);
    return x + tp::copy_to_tp(pos, ctx.tp).narrow(0, part * tp::tp_rank(ctx.tp), part);
  }
  return x + pos.narrow(0, 0, tokens.size(1));
}

GptBlockImpl::GptBlockImpl(const ModelConfig& c, int64_t index) {
  const std::string p = "blocks." + std::to_string(index) + ".";
  head_dim = c.hidden / c.heads;
  const InitSpec normal = InitSpec::normal(0, 0.02);
  // GPT-2: residual projections scaled by 1/sqrt(2 * layers).
  const InitSpec residual = InitSpec::normal(0, 0.02 / std::sqrt(2.0 * c.layers));
  const int64_t h = c.hidden;
  ln1 = register_module("ln1", layer_norm(h));
  q = register_module("q", seeded_linear(h, h, true, c.seed, p + "q", normal));
  k = register_module("k", seeded_linear(h, h, true, c.seed, p + "k", normal));
  v = register_module("v", seeded_linear(h, h, true, c.seed, p + "v", normal));
  proj = register_module("proj", seeded_linear(h, h, true, c.seed, p + "proj", residual));
  ln2 = register_module("ln2", layer_norm(h));
  fc1 = register_module("fc1", seeded_linear(h, 4 * h, true, c.seed, p + "fc1", normal));
  fc2 = register_module("fc2", seeded_linear(4 * h, h, true, c.seed, p + "fc2", residual));
}

at::Tensor GptBlockImpl::attention(const at::Tensor& x) {
  // Sizes from q's output: under tensor parallelism it holds this rank's heads,
  // under sequence parallelism the whole sequence (x holds a part).
  const at::Tensor q_out = q->forward(x);
  const int64_t B = q_out.size(0), T = q_out.size(1), local_heads = q_out.size(2) / head_dim;
  auto heads = [&](const at::Tensor& t) { return t.view({B, T, local_heads, head_dim}).transpose(1, 2); };
  at::Tensor qh = heads(q_out), kh = heads(k->forward(x)), vh = heads(v->forward(x));
  at::Tensor scores = at::matmul(qh, kh.transpose(-2, -1)) / std::sqrt(static_cast<double>(head_dim));
  at::Tensor future = at::ones({T, T}, at::TensorOptions().dtype(at::kBool)).triu(1);
  scores = scores.masked_fill(future, -std::numeric_limits<float>::infinity());
  at::Tensor y = at::matmul(at::softmax(scores, -1), vh);  // [B, heads, T, head_dim]
  return proj->forward(y.transpose(1, 2).reshape({B, T, local_heads * head_dim}));
}

at::Tensor GptBlockImpl::forward(const at::Tensor& x) {
  at::Tensor h = x + attention(ln1->forward(x));
  return h + fc2->forward(at::gelu(fc1->forward(ln2->forward(h))));
}

GptHeadImpl::GptHeadImpl(const ModelConfig& c, const BuildContext& ctx, at::Tensor tied_weight)
    : tied(std::move(tied_weight)) {
  ln = register_module("ln", layer_norm(c.hidden));
  if (!c.tie_embeddings) {
    out = register_module("out", seeded_linear(c.hidden, c.vocab, false, c.seed, "head.out", InitSpec::normal(0, 0.02)));
  } else if (ctx.tied_head_copy) {  // Note [Tied embeddings across pipeline stages]
    out = register_module("out", torch::nn::Linear(torch::nn::LinearOptions(c.hidden, c.vocab).bias(false)));
    at::NoGradGuard no_grad;
    out->weight.copy_(token_embedding_values(c));
  }
}

at::Tensor GptHeadImpl::forward(const at::Tensor& x) {
  // Logits of this rank's vocabulary rows under tensor parallelism (the loss is vocab-parallel).
  at::Tensor h = ln->forward(x);
  if (out) return out->forward(h);
  MESHTRAIN_CHECK(tied.defined(), "GptHead: the LM head is tied to an embedding on another pipeline stage of this "
                  "rank and has not been given its weight (set_tied)");
  return at::matmul(h, tied.t());
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

std::map<std::string, tp::Style> tp_plan(const ModelConfig& c, torch::nn::Module& stage, bool sequence_parallel) {
  std::map<std::string, tp::Style> plan;
  for (const auto& item : stage.named_modules("", /*include_self=*/false)) {
    const std::string& path = item.key();
    const std::string name = path.substr(path.rfind('.') + 1);
    if (c.kind == "mlp") {
      // Pairs (2k, 2k + 1): Megatron's MLP, one all-reduce per pair each way; an odd last layer stays whole.
      if (path.rfind("layers.", 0) != 0 || name == "layers") continue;
      const int64_t i = std::stoll(name);
      if (i % 2 == 0 && i + 1 < c.layers) plan[path] = tp::Style::kColwise;
      if (i % 2 == 1) plan[path] = tp::Style::kRowwise;
    } else if (name == "q" || name == "k" || name == "v" || name == "fc1" || path == "head.out") {
      plan[path] = tp::Style::kColwise;
    } else if (name == "proj" || name == "fc2") {
      plan[path] = tp::Style::kRowwise;
    } else if (path == "embed.tok") {
      plan[path] = tp::Style::kVocabParallel;
    } else if (sequence_parallel && item.value()->as<torch::nn::LayerNormImpl>()) {
      plan[path] = tp::Style::kSequenceParallel;
    }
  }
  return plan;
}

Stage build_stage(const ModelConfig& c, int64_t first, int64_t last, const BuildContext& ctx) {
  validate(c, tp::tp_size(ctx.tp), ctx.sequence_parallel);
  const int64_t n = num_pieces(c);
  MESHTRAIN_CHECK(first >= 0 && first < last && last <= n, "build_stage: pieces [", first, ", ", last,
                  ") out of range for a model of ", n, " pieces");
  Stage stage;
  if (c.kind == "mlp") {
    for (int64_t i = first; i < last; ++i) {
      const int64_t in = i == 0 ? c.features : c.hidden;
      const int64_t out = i == c.layers - 1 ? c.classes : c.hidden;
      const std::string key = std::to_string(i);
      stage->append("layers", key, MlpLayer(in, out, /*relu=*/i != c.layers - 1, c.seed, "layers." + key));
    }
  } else {
    at::Tensor embedding_weight;
    for (int64_t i = first; i < last; ++i) {
      if (i == 0) {
        GptEmbedding e(c, ctx);
        embedding_weight = e->tok->weight;
        stage->append("", "embed", e);
      } else if (i == n - 1) {
        stage->append("", "head", GptHead(c, ctx, c.tie_embeddings ? embedding_weight : at::Tensor()));
      } else {
        stage->append("blocks", std::to_string(i - 1), GptBlock(c, i - 1));
      }
    }
  }
  // The dense stage, cut the way a user's model is (the same values on every tp rank).
  if (tp::tp_size(ctx.tp) > 1) {
    tp::parallelize(*stage, ctx.tp, tp_plan(c, *stage, ctx.sequence_parallel), {ctx.sequence_parallel});
  }
  return stage;
}

at::Tensor loss(const ModelConfig& c, const at::Tensor& output, const at::Tensor& targets, const BuildContext& ctx) {
  if (c.kind == "mlp") return at::cross_entropy_loss(output, targets);
  return tp::vocab_parallel_cross_entropy(output.reshape({-1, output.size(-1)}), targets.reshape({-1}), ctx.tp);
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
  const int64_t h = c.hidden;
  const int64_t block = 2 * 2 * h + 4 * (h * h + h) + (h * 4 * h + 4 * h) + (4 * h * h + h);
  return c.vocab * h + c.seq_len * h + c.layers * block + 2 * h + (c.tie_embeddings ? 0 : c.vocab * h);
}

}  // namespace models
}  // namespace meshtrain
