#include "meshtrain/tp.h"

#include <ATen/ATen.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include "meshtrain/util.h"
#include "util/shard.h"
#include "tp/cut.h"

namespace meshtrain {
namespace tp {

namespace {

// ---- the plan

// The other name of `weight` in `model` (a head tied to the embedding at `path`), or "".
std::string tied_to(torch::nn::Module& model, const std::string& path, const at::Tensor& weight) {
  for (const auto& p : model.named_parameters()) {
    if (p.value().is_same(weight) && p.key() != path + ".weight") return p.key();
  }
  return "";
}

// A head tied to the vocabulary-parallel embedding at `path` is cut with it:
// the cuts must be equal (for tp::vocab_parallel_cross_entropy), and a bias
// of the whole vocabulary, or a 1 x 1 slice (not told from its transpose),
// cannot follow.
void check_tied_head(torch::nn::Module& model, const std::string& path, const at::Tensor& weight, int tp) {
  const std::string tied = tied_to(model, path, weight);
  if (tied.empty()) return;
  const std::string where = str_cat("tp::parallelize: Embedding '", path, "' shares its weight with '", tied,
                                    "' (a tied LM head), whose logits are cut by vocabulary with it");
  MESHTRAIN_CHECK(weight.size(0) % tp == 0, where, " for tp::vocab_parallel_cross_entropy, which needs equal cuts: its ",
                  weight.size(0), " rows are not a multiple of tp ", tp, "; pad the vocabulary to a multiple of ", tp);
  MESHTRAIN_CHECK(weight.size(0) / tp > 1 || weight.size(1) > 1, where, ", but each rank would keep a 1 x 1 slice, "
                  "which cannot be told from its transpose; leave such a small embedding whole");
  const std::string owner = tied.substr(0, tied.rfind('.') + 1);  // "lm_head." or "" for a parameter of the root
  for (const auto& p : model.named_parameters()) {
    MESHTRAIN_CHECK(owner.empty() || p.key() != owner + "bias", where, ", but '", p.key(), "' is a bias over the "
                    "whole vocabulary; build the head without a bias (as GPT-2's)");
  }
}

// The divisors of n up to 64, for errors naming the valid tp sizes.
std::string divisors(int64_t n) {
  std::string out;
  for (int64_t d = 1; d <= n && d <= 64; ++d)
    if (n % d == 0) out += (out.empty() ? "" : ", ") + std::to_string(d);
  return out;
}

const char* enum_name(Style style) {
  switch (style) {
    case Style::kColwise: return "kColwise";
    case Style::kRowwise: return "kRowwise";
    case Style::kVocabParallel: return "kVocabParallel";
    case Style::kSequenceParallel: return "kSequenceParallel";
  }
  return "?";
}

void check_embedding(torch::nn::Module& model, const std::string& path, torch::nn::Module& m, int tp) {
  auto* e = m.as<torch::nn::EmbeddingImpl>();
  MESHTRAIN_CHECK(e, "tp::parallelize: '", path, "' is a ", m.name(), "; kVocabParallel applies to torch::nn::Embedding");
  MESHTRAIN_CHECK(sliced_dim(e->weight) < 0, "tp::parallelize: '", path, "' is already cut (parallelize a model once)");
  MESHTRAIN_CHECK(!e->options.max_norm(), "tp::parallelize: Embedding '", path, "' has max_norm, which renormalizes "
                  "rows by global index; build it without max_norm");
  MESHTRAIN_CHECK(e->weight.size(0) >= tp, "tp::parallelize: Embedding '", path, "' has ", e->weight.size(0),
                  " rows, fewer than tp ", tp);
  check_tied_head(model, path, e->weight, tp);
}

void check_linear(const std::string& path, torch::nn::Module& m, Style style, int tp) {
  auto* linear = m.as<torch::nn::LinearImpl>();
  MESHTRAIN_CHECK(linear, "tp::parallelize: '", path, "' is a ", m.name(), "; ", enum_name(style),
                  " applies to torch::nn::Linear (and kVocabParallel to torch::nn::Embedding)");
  MESHTRAIN_CHECK(sliced_dim(linear->weight) < 0, "tp::parallelize: '", path, "' is already cut (parallelize a "
                  "model once)");
  const int64_t dim = style == Style::kColwise ? 0 : 1, full = linear->weight.size(dim);
  MESHTRAIN_CHECK(full % tp == 0, "tp::parallelize: '", path, "' has ", full,
                  style == Style::kColwise ? " output" : " input", " features, which tp ", tp, " does not divide; "
                  "choose tp in {", divisors(full), "}");
  // The cut dimension is recognised by (stride, size); only a 1 x 1 slice
  // looks the same as its transpose.
  MESHTRAIN_CHECK(full / tp > 1 || linear->weight.size(1 - dim) > 1, "tp::parallelize: '", path, "' would keep a "
                  "1 x 1 slice, which cannot be told from its transpose; leave such a small layer dense");
}

void check_sequence_parallel_module(const std::string& path, torch::nn::Module& m, const ParallelizeOptions& options) {
  MESHTRAIN_CHECK(options.sequence_parallel, "tp::parallelize: '", path, "' is planned kSequenceParallel, which "
                  "needs ParallelizeOptions{.sequence_parallel = true}");
  MESHTRAIN_CHECK(m.children().empty(), "tp::parallelize: '", path, "' (a ", m.name(), ") is planned "
                  "kSequenceParallel, which applies to a module without children whose parameters are replicated (a "
                  "LayerNorm)");
}

// A replicated table read by the whole sequence's indices (kSequenceParallel
// on an Embedding or a parameter): checked before anything is changed.
void check_sequence_table(const std::string& path, const at::Tensor& table, const ParallelizeOptions& options) {
  MESHTRAIN_CHECK(options.sequence_parallel, "tp::parallelize: '", path, "' is planned kSequenceParallel, which "
                  "needs ParallelizeOptions{.sequence_parallel = true}");
  MESHTRAIN_CHECK(table.dim() == 2 && intercept::roles_of(table).empty(), "tp::parallelize: '", path, "' is planned "
                  "kSequenceParallel as a table read by at::embedding: it must be a replicated 2-d parameter not yet "
                  "parallelized; got ", table.sizes());
}

// The parameter at `path` ("embed.pos"), or an undefined tensor.
at::Tensor parameter_at(torch::nn::Module& model, const std::string& path) {
  const size_t dot = path.rfind('.');
  const std::string owner = dot == std::string::npos ? "" : path.substr(0, dot);
  const std::string name = dot == std::string::npos ? path : path.substr(dot + 1);
  for (const auto& item : model.named_modules()) {
    if (item.key() != owner) continue;
    const auto params = item.value()->named_parameters(/*recurse=*/false);
    if (const at::Tensor* p = params.find(name)) return *p;
  }
  return at::Tensor();
}

// The layer at `path`, checked against its style before anything is changed.
torch::nn::Module& layer_at(torch::nn::Module& model, const std::string& path, Style style, int tp,
                            const ParallelizeOptions& options) {
  for (const auto& item : model.named_modules("", /*include_self=*/false)) {
    if (item.key() != path) continue;
    torch::nn::Module& m = *item.value();
    if (style == Style::kVocabParallel) {
      check_embedding(model, path, m, tp);
    } else if (style == Style::kSequenceParallel && m.as<torch::nn::EmbeddingImpl>()) {
      check_sequence_table(path, m.as<torch::nn::EmbeddingImpl>()->weight, options);
    } else if (style == Style::kSequenceParallel) {
      check_sequence_parallel_module(path, m, options);
    } else {
      check_linear(path, m, style, tp);
    }
    return m;
  }
  std::string paths;
  for (const auto& item : model.named_modules("", false))
    if (item.value()->as<torch::nn::LinearImpl>() || item.value()->as<torch::nn::EmbeddingImpl>())
      paths += (paths.empty() ? "" : ", ") + item.key();
  throw ConfigError(str_cat("tp::parallelize: the model has no layer '", path, "'; its Linear and Embedding layers are [",
                            paths, "]"));
}

// Under sequence parallelism a LayerNorm left out of the plan would step on
// its part of the sequence's gradient only.
void require_norms_planned(torch::nn::Module& model, const std::map<std::string, Style>& plan) {
  std::string missing;
  for (const auto& item : model.named_modules("", false)) {
    bool trainable = false;  // a norm without affine parameters, or frozen, has no gradient to sum
    for (const auto& p : item.value()->parameters(false)) trainable = trainable || p.requires_grad();
    if (!item.value()->as<torch::nn::LayerNormImpl>() || !trainable) continue;
    auto it = plan.find(item.key());
    if (it == plan.end() || it->second != Style::kSequenceParallel) missing += (missing.empty() ? "" : ", ") + item.key();
  }
  MESHTRAIN_CHECK(missing.empty(), "tp::parallelize with sequence_parallel: the LayerNorms [", missing, "] see a part "
                  "of the sequence each; plan them kSequenceParallel, which sums their gradients over tp");
}

void slice_linear(torch::nn::LinearImpl& linear, Style style, const comm::CommPtr& tp, bool sequence_parallel) {
  at::Tensor& w = linear.weight;
  const int64_t dim = style == Style::kColwise ? 0 : 1, local = w.size(dim) / tp->size(), start = local * tp->rank();
  at::NoGradGuard no_grad;
  w.set_data(w.narrow(dim, start, local).clone());  // the same parameter tensor, resized
  intercept::mark(w, std::make_shared<Cut>(tp, style, sequence_parallel, w));  // after set_data, which copies key sets
  add_kernel_key(w);
  if (!linear.bias.defined()) return;
  if (style == Style::kColwise) {
    linear.bias.set_data(linear.bias.narrow(0, start, local).clone());
    intercept::mark(linear.bias, std::make_shared<CutBias>());
  } else if (sequence_parallel && linear.bias.requires_grad()) {
    sum_gradient_over_tp(linear.bias, tp);  // added to this rank's part of the sequence only
  }
}

// Any product x E^T by the embedding's rows (a tied head, registered or not)
// computes as a kColwise layer: its logits are this rank's vocabulary (for
// tp::vocab_parallel_cross_entropy), its input's gradient summed over tp.
// Only with equal cuts: with unequal ones such a product is refused.
void slice_embedding(torch::nn::EmbeddingImpl& embedding, const comm::CommPtr& tp, bool sequence_parallel) {
  at::Tensor& w = embedding.weight;
  const int64_t vocab = w.size(0);
  const Range rows = shard_range(vocab, tp->size(), tp->rank());  // sizes need not divide
  at::NoGradGuard no_grad;
  w.set_data(w.narrow(0, rows.offset, rows.size).clone());
  // libtorch's functional checks padding_idx against the weight's (now local)
  // rows before dispatch: the global index moves into the kernel's record.
  const int64_t padding_idx = embedding.options.padding_idx().value_or(-1);
  embedding.options.padding_idx(c10::nullopt);
  intercept::mark(w, std::make_shared<VocabRows>(tp, rows, padding_idx, sequence_parallel));
  if (vocab % tp->size() == 0) intercept::mark(w, std::make_shared<Cut>(tp, Style::kColwise, sequence_parallel, w));
  add_kernel_key(w);
}

// Once per parameter, whatever the number of paths to its module.
void sum_gradients_over_tp(torch::nn::Module& m, const comm::CommPtr& tp) {
  for (at::Tensor& p : m.parameters(/*recurse=*/false)) {
    if (!p.requires_grad() || summed_over_tp(p)) continue;
    sum_gradient_over_tp(p, tp);
  }
}

// One entry of the plan, checked: the layer at `path` (or, a table planned
// kSequenceParallel, the parameter) and how it is cut.
struct PlannedLayer {
  std::string path;
  torch::nn::Module* module;
  Style style;
  at::Tensor table;  // a parameter path's tensor, or an Embedding planned kSequenceParallel's weight
  const at::Tensor* weight() const {
    if (table.defined()) return &table;
    if (auto* e = module->as<torch::nn::EmbeddingImpl>()) return &e->weight;
    if (auto* l = module->as<torch::nn::LinearImpl>()) return &l->weight;
    return nullptr;
  }
};

// The plan's entry at `path`: a module, or a table parameter planned kSequenceParallel.
PlannedLayer planned_at(torch::nn::Module& model, const std::string& path, Style style, int tp,
                        const ParallelizeOptions& options) {
  if (style == Style::kSequenceParallel) {
    const at::Tensor table = parameter_at(model, path);
    if (table.defined()) {
      check_sequence_table(path, table, options);
      return {path, nullptr, style, table};
    }
  }
  torch::nn::Module& m = layer_at(model, path, style, tp, options);
  auto* e = m.as<torch::nn::EmbeddingImpl>();
  return {path, &m, style, style == Style::kSequenceParallel && e ? e->weight : at::Tensor()};
}

// A weight planned twice would be cut twice: a head tied to a kVocabParallel
// embedding follows it, and a layer registered at two paths is planned once.
void refuse_weights_planned_twice(const std::vector<PlannedLayer>& layers) {
  for (const PlannedLayer& first : layers) {
    for (const PlannedLayer& other : layers) {
      if (&other == &first || !first.weight() || !other.weight() || !other.weight()->is_same(*first.weight())) continue;
      MESHTRAIN_CHECK(first.style != Style::kVocabParallel, "tp::parallelize: '", other.path, "' shares its weight "
                      "with the kVocabParallel Embedding '", first.path, "' (tied): leave it out of the plan, it is "
                      "cut with the embedding");
      MESHTRAIN_CHECK(other.style == Style::kVocabParallel, "tp::parallelize: '", first.path, "' and '", other.path,
                      "' are one layer (or share their weight): plan it once");
    }
  }
}

}  // namespace

void parallelize(torch::nn::Module& model, const comm::CommPtr& tp, const std::map<std::string, Style>& plan,
                 ParallelizeOptions options) {
  MESHTRAIN_CHECK(tp, "tp::parallelize needs a communicator");
  std::vector<PlannedLayer> layers;
  for (const auto& kv : plan) layers.push_back(planned_at(model, kv.first, kv.second, tp->size(), options));
  refuse_weights_planned_twice(layers);  // all checked before anything changes
  if (options.sequence_parallel) require_norms_planned(model, plan);
  if (tp->size() == 1) return;
  const bool sp = options.sequence_parallel;
  for (const PlannedLayer& l : layers) {
    if (l.table.defined()) {
      mark_sequence_rows(l.table, tp);
    } else if (l.style == Style::kVocabParallel) {
      slice_embedding(*l.module->as<torch::nn::EmbeddingImpl>(), tp, sp);
    } else if (l.style == Style::kSequenceParallel) {
      sum_gradients_over_tp(*l.module, tp);
    } else {
      slice_linear(*l.module->as<torch::nn::LinearImpl>(), l.style, tp, sp);
    }
  }
}

void parallelize(torch::nn::Module& model, const comm::CommPtr& tp, const std::map<std::string, std::string>& plan,
                 ParallelizeOptions options) {
  std::map<std::string, Style> styles;
  for (const auto& kv : plan) styles[kv.first] = parse_style(kv.second);
  parallelize(model, tp, styles, options);
}

Style parse_style(const std::string& name) {
  for (Style s : {Style::kColwise, Style::kRowwise, Style::kVocabParallel, Style::kSequenceParallel})
    if (style_name(s) == name) return s;
  throw ConfigError(str_cat("tp::parse_style: '", name, "' is not a tensor-parallel style; use colwise, rowwise, "
                            "vocab_parallel or sequence_parallel"));
}

std::string style_name(Style style) {
  switch (style) {
    case Style::kColwise: return "colwise";
    case Style::kRowwise: return "rowwise";
    case Style::kVocabParallel: return "vocab_parallel";
    case Style::kSequenceParallel: return "sequence_parallel";
  }
  return "?";
}

int64_t sliced_dim(const at::Tensor& param) {
  for (const auto& r : intercept::roles_of(param)) {
    if (auto* c = dynamic_cast<const Cut*>(r.first)) return c->dim;
    if (dynamic_cast<const CutBias*>(r.first) || dynamic_cast<const VocabRows*>(r.first)) return 0;
  }
  return -1;
}

}  // namespace tp
}  // namespace meshtrain
