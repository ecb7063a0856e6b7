#include "meshtrain/models/models.h"

#include <ATen/ATen.h>

#include <cmath>

#include "meshtrain/tp/ops.h"
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

int64_t num_pieces(const ModelConfig& c) { return c.kind == "gpt" ? c.layers + 2 : c.layers; }

GptEmbeddingImpl::GptEmbeddingImpl(const ModelConfig& c, const BuildContext& context) : ctx(context) {
  tok = register_module("tok", tp::VocabParallelEmbedding(tp::VocabParallelEmbeddingOptions(c.vocab, c.hidden)
                                                              .tp(ctx.tp)
                                                              .sequence_parallel(ctx.sequence_parallel)
                                                              .seed(c.seed)
                                                              .name("embed.tok")));
  pos = register_parameter("pos", init_full(c.seed, "embed.pos", InitSpec::normal(0, 0.01), {c.seq_len, c.hidden}));
}

at::Tensor GptEmbeddingImpl::forward(const at::Tensor& tokens) {
  MESHTRAIN_CHECK(tokens.dim() == 2 && tokens.size(1) <= pos.size(0), "GPT input must be [batch, seq <= ",
                  pos.size(0), "] token ids; got ", tokens.sizes());
  at::Tensor x = tok->forward(tokens);
  if (ctx.sequence_parallel && tp::tp_size(ctx.tp) > 1) {
    // This rank holds positions [r*T/tp, (r+1)*T/tp) and adds those rows, so
    // each rank's gradient covers its rows only: copy_to_tp (before slicing)
    // sums them into the full gradient on every rank.
    const int64_t part = x.size(1);
    return x + tp::copy_to_tp(pos, ctx.tp).narrow(0, part * tp::tp_rank(ctx.tp), part);
  }
  return x + pos.narrow(0, 0, tokens.size(1));
}

GptBlockImpl::GptBlockImpl(const ModelConfig& c, int64_t index, const BuildContext& context) : ctx(context) {
  const std::string p = "blocks." + std::to_string(index);
  const int tp_n = tp::tp_size(ctx.tp);
  MESHTRAIN_CHECK(c.heads % tp_n == 0, "tp size ", tp_n, " does not divide --heads ", c.heads,
                  "; choose tp among the divisors of ", c.heads);
  local_heads = c.heads / tp_n;
  head_dim = c.hidden / c.heads;
  // GPT-2: residual projections scaled by 1/sqrt(2 * layers).
  const InitSpec residual = InitSpec::normal(0, 0.02 / std::sqrt(2.0 * c.layers));
  // q, k, v (and fc1) read one input, prepared once by the block (enter()).
  auto col = [&](const std::string& name, int64_t in, int64_t out) {
    return tp::ColumnParallelLinear(tp::ColumnParallelLinearOptions(in, out).tp(ctx.tp).seed(c.seed).name(p + "." + name)
                                        .sequence_parallel(ctx.sequence_parallel).input_is_prepared(true));
  };
  auto row = [&](const std::string& name, int64_t in, int64_t out) {
    return tp::RowParallelLinear(tp::RowParallelLinearOptions(in, out).tp(ctx.tp).seed(c.seed).name(p + "." + name)
                                     .weight_init(residual).sequence_parallel(ctx.sequence_parallel));
  };
  ln1 = register_module("ln1", layer_norm(c.hidden));
  q = register_module("q", col("q", c.hidden, c.hidden));
  k = register_module("k", col("k", c.hidden, c.hidden));
  v = register_module("v", col("v", c.hidden, c.hidden));
  proj = register_module("proj", row("proj", c.hidden, c.hidden));
  ln2 = register_module("ln2", layer_norm(c.hidden));
  fc1 = register_module("fc1", col("fc1", c.hidden, 4 * c.hidden));
  fc2 = register_module("fc2", row("fc2", 4 * c.hidden, c.hidden));
}

at::Tensor GptBlockImpl::attention(const at::Tensor& x) {
  const int64_t B = x.size(0), T = x.size(1);
  auto heads = [&](const at::Tensor& t) { return t.view({B, T, local_heads, head_dim}).transpose(1, 2); };
  at::Tensor qh = heads(q->forward(x)), kh = heads(k->forward(x)), vh = heads(v->forward(x));
  at::Tensor scores = at::matmul(qh, kh.transpose(-2, -1)) / std::sqrt(static_cast<double>(head_dim));
  at::Tensor future = at::ones({T, T}, at::TensorOptions().dtype(at::kBool)).triu(1);
  scores = scores.masked_fill(future, -std::numeric_limits<float>::infinity());
  at::Tensor y = at::matmul(at::softmax(scores, -1), vh);  // [B, heads, T, head_dim]
  return proj->forward(y.transpose(1, 2).reshape({B, T, local_heads * head_dim}));
}

namespace {

// Into a tensor-parallel region: all-gather the sequence (SP) or copy_to_tp.
at::Tensor enter(const at::Tensor& x, const BuildContext& ctx) {
  return ctx.sequence_parallel ? tp::gather_from_sp(x, ctx.tp) : tp::copy_to_tp(x, ctx.tp);
}

at::Tensor norm(const torch::nn::LayerNorm& ln, const at::Tensor& x, const BuildContext& ctx) {
  return tp::layer_norm(x, ln->weight, ln->bias, ctx.tp, ctx.sequence_parallel);
}

}  // namespace

at::Tensor GptBlockImpl::forward(const at::Tensor& x) {
  at::Tensor h = x + attention(enter(norm(ln1, x, ctx), ctx));
  return h + fc2->forward(at::gelu(fc1->forward(enter(norm(ln2, h, ctx), ctx))));
}

GptHeadImpl::GptHeadImpl(const ModelConfig& c, const BuildContext& ctx, at::Tensor tied_weight)
    : tied(std::move(tied_weight)), tp(ctx.tp), sequence_parallel(ctx.sequence_parallel) {
  ln = register_module("ln", layer_norm(c.hidden));
  if (!c.tie_embeddings) {
    // Vocabulary rows split over tp, like the embedding it would be tied to.
    out = register_module("out", tp::ColumnParallelLinear(tp::ColumnParallelLinearOptions(c.hidden, c.vocab)
                                                              .bias(false).tp(ctx.tp).seed(c.seed).name("head.out")
                                                              .input_is_prepared(true)));
  }
}

at::Tensor GptHeadImpl::out_weight() const {
  if (out) return out->weight;
  MESHTRAIN_CHECK(tied.defined(), "GptHead: the LM head is tied to an embedding on another pipeline stage and has "
                  "not been given its weight (set_tied) for this step");
  return tied;
}

at::Tensor GptHeadImpl::forward(const at::Tensor& x) {
  // Logits of this rank's vocabulary slice; the loss is vocab-parallel.
  at::Tensor h = tp::layer_norm(x, ln->weight, ln->bias, tp, sequence_parallel);
  h = sequence_parallel ? tp::gather_from_sp(h, tp) : tp::copy_to_tp(h, tp);
  return at::matmul(h, out_weight().t());
}

MlpLayerImpl::MlpLayerImpl(int64_t in, int64_t out, bool relu_after, uint64_t seed, const std::string& name)
    : relu(relu_after) {
  weight = register_parameter("weight", init_full(seed, name + ".weight", torch_linear_init(in), {out, in}));
  bias = register_parameter("bias", init_full(seed, name + ".bias", torch_linear_init(in), {out}));
}

at::Tensor MlpLayerImpl::forward(const at::Tensor& x) {
  at::Tensor y = at::linear(x, weight, bias);
  return relu ? at::relu(y) : y;
}

MlpColumnImpl::MlpColumnImpl(int64_t in, int64_t out, uint64_t seed, const std::string& name, comm::CommPtr tp)
    : tp::ColumnParallelLinearImpl(tp::ColumnParallelLinearOptions(in, out).tp(std::move(tp)).seed(seed).name(name)
                                       .weight_init(torch_linear_init(in)).bias_init(torch_linear_init(in))) {}

at::Tensor MlpColumnImpl::forward(const at::Tensor& x) { return at::relu(ColumnParallelLinearImpl::forward(x)); }

MlpRowImpl::MlpRowImpl(int64_t in, int64_t out, bool relu_after, uint64_t seed, const std::string& name, comm::CommPtr tp)
    : tp::RowParallelLinearImpl(tp::RowParallelLinearOptions(in, out).tp(std::move(tp)).seed(seed).name(name)
                                    .weight_init(torch_linear_init(in)).bias_init(torch_linear_init(in))),
      relu(relu_after) {}

at::Tensor MlpRowImpl::forward(const at::Tensor& x) {
  at::Tensor y = RowParallelLinearImpl::forward(x);
  return relu ? at::relu(y) : y;
}

Stage build_stage(const ModelConfig& c, int64_t first, int64_t last, const BuildContext& ctx) {
  validate(c, tp::tp_size(ctx.tp), ctx.sequence_parallel);
  const int64_t n = num_pieces(c);
  MESHTRAIN_CHECK(first >= 0 && first < last && last <= n, "build_stage: pieces [", first, ", ", last,
                  ") out of range for a model of ", n, " pieces");
  Stage stage;
  if (c.kind == "mlp") {
    const bool parallel = tp::tp_size(ctx.tp) > 1;
    for (int64_t i = first; i < last; ++i) {
      const int64_t in = i == 0 ? c.features : c.hidden;
      const int64_t out = i == c.layers - 1 ? c.classes : c.hidden;
      const bool relu = i != c.layers - 1;
      const std::string key = std::to_string(i), name = "layers." + key;
      if (parallel && i % 2 == 0 && i + 1 < c.layers) {
        stage->append("layers", key, MlpColumn(in, out, c.seed, name, ctx.tp));
      } else if (parallel && i % 2 == 1) {
        stage->append("layers", key, MlpRow(in, out, relu, c.seed, name, ctx.tp));
      } else {
        stage->append("layers", key, MlpLayer(in, out, relu, c.seed, name));
      }
    }
    return stage;
  }
  at::Tensor embedding_weight;
  for (int64_t i = first; i < last; ++i) {
    if (i == 0) {
      GptEmbedding e(c, ctx);
      embedding_weight = e->tok->weight;
      stage->append("", "embed", e);
    } else if (i == n - 1) {
      stage->append("", "head", GptHead(c, ctx, c.tie_embeddings ? embedding_weight : at::Tensor()));
    } else {
      stage->append("blocks", std::to_string(i - 1), GptBlock(c, i - 1, ctx));
    }
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
