#include "meshtrain/tp/parallelize.h"

#include <ATen/ATen.h>
#include <torch/library.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>

#include <mutex>

#include "meshtrain/tp/ops.h"
#include "meshtrain/util/error.h"
#include "meshtrain/util/shard.h"
#include "util/intercept.h"

namespace meshtrain {
namespace tp {

namespace {

// A sliced weight: its communicator and the dimension it was sliced along
// (by stride and size, which tell W from its transposed view W^T). Every
// operation on it comes to run(): matrix products that contract over the
// slice give partial sums, all-reduced over tp (Megatron's f and g).
class Slice : public intercept::Role {
 public:
  Slice(comm::CommPtr tp, int64_t stride, int64_t size) : tp_(std::move(tp)), stride_(stride), size_(size) {}

  bool run(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) override {
    const std::string& name = op.schema().name();
    const size_t nargs = op.schema().arguments().size();
    if (name != "aten::mm" && name != "aten::matmul" && name != "aten::addmm") {
      const bool contraction = name == "aten::bmm" || name == "aten::baddbmm" || name == "aten::mv" ||
                               name == "aten::addmv" || name == "aten::dot" || name == "aten::addbmm";
      MESHTRAIN_CHECK(!contraction, "tp::parallelize: ", name, " on a sliced weight is not supported (only the "
                      "matrix products of torch::nn::Linear's forward and backward are); a partial sum would be "
                      "silently wrong");
      return false;
    }
    auto args = torch::jit::last(*stack, nargs);
    const int lhs = name == "aten::addmm" ? 1 : 0;  // addmm(bias, mat1, mat2, beta, alpha)
    if (!contracts_me(args[lhs].toTensor(), false) && !contracts_me(args[lhs + 1].toTensor(), true)) return false;
    if (name == "aten::addmm") {  // the bias is added once, after the sum
      const at::Tensor bias = args[0].toTensor(), m1 = args[1].toTensor(), m2 = args[2].toTensor();
      const at::Scalar beta = args[3].toScalar(), alpha = args[4].toScalar();
      torch::jit::drop(*stack, nargs);
      at::Tensor out = at::mm(m1, m2);
      if (alpha.toDouble() != 1.0) out.mul_(alpha);
      tp_->all_reduce(out, comm::ReduceOp::kSum);
      out.add_(bias, beta);
      torch::jit::push(*stack, out);
      return true;
    }
    intercept::redispatch(op, keys, stack);
    tp_->all_reduce(stack->back().toTensor(), comm::ReduceOp::kSum);
    return true;
  }

 private:
  // Is `t` (an operand of a matrix product) this slice, contracted over its sliced dimension?
  bool contracts_me(const at::Tensor& t, bool is_rhs) const {
    bool mine = false;
    for (const auto& r : intercept::roles_of(t)) mine = mine || r.first == this;
    if (!mine) return false;
    const int64_t d = is_rhs ? (t.dim() == 1 ? 0 : t.dim() - 2) : t.dim() - 1;
    return t.stride(d) == stride_ && t.size(d) == size_;
  }

  comm::CommPtr tp_;
  int64_t stride_ = 0, size_ = 0;
};

// ---- vocabulary-parallel Embedding
//
// aten::embedding's backward sees only the indices and the number of rows, so
// the shift of the indices into this rank's rows must happen before autograd
// records the operation: a kernel for aten::embedding at DispatchKey::
// DeferredInit, a key above autograd that libtorch 1.13 leaves unused (every
// other operation falls through it). The marker key below autograd also sits
// on the weight, so zero::fully_shard can shard it.
constexpr c10::DispatchKey kBeforeAutograd = c10::DispatchKey::DeferredInit;

// This rank's rows of a vocabulary-parallel embedding.
class VocabRows : public intercept::Role {
 public:
  VocabRows(comm::CommPtr tp, Range rows, int64_t padding_idx) : tp(std::move(tp)), rows(rows), padding_idx(padding_idx) {}
  comm::CommPtr tp;
  Range rows;
  int64_t padding_idx;  // global; -1: none
};

const VocabRows* vocab_rows_of(const at::Tensor& weight) {
  for (const auto& r : intercept::roles_of(weight))
    if (auto* v = dynamic_cast<const VocabRows*>(r.first)) return v;
  return nullptr;
}

// Megatron's VocabParallelEmbedding: look up the indices in this rank's rows,
// zeros for the others, summed over tp (the sum's backward is the identity).
at::Tensor vocab_parallel_embedding(const at::Tensor& weight, const at::Tensor& indices, int64_t padding_idx,
                                    bool scale_grad_by_freq, bool sparse) {
  c10::impl::ExcludeDispatchKeyGuard below(kBeforeAutograd);
  const VocabRows* v = vocab_rows_of(weight);
  if (!v) return at::embedding(weight, indices, padding_idx, scale_grad_by_freq, sparse);
  MESHTRAIN_CHECK(!scale_grad_by_freq && !sparse, "tp::parallelize: a vocabulary-parallel Embedding supports neither "
                  "scale_grad_by_freq nor sparse gradients; build the Embedding without them");
  const at::Tensor outside = indices.lt(v->rows.offset).logical_or(indices.ge(v->rows.end()));
  const at::Tensor local = (indices - v->rows.offset).masked_fill(outside, 0);
  const int64_t pad = v->padding_idx;  // the module's own is cleared: libtorch checks it against the local rows
  const bool pad_is_mine = pad >= v->rows.offset && pad < v->rows.end();
  const at::Tensor partial = at::embedding(weight, local, pad_is_mine ? pad - v->rows.offset : -1, false, false)
                                 .masked_fill(outside.unsqueeze(-1), 0);
  return reduce_from_tp(partial, v->tp);
}

void install_embedding_kernel_once() {
  static std::once_flag once;
  static std::unique_ptr<torch::Library> kernels, fallthrough;
  std::call_once(once, [] {
    MESHTRAIN_CHECK(!c10::Dispatcher::singleton().hasBackendFallbackForDispatchKey(kBeforeAutograd),
                    "tp::parallelize: this libtorch already uses dispatch key DeferredInit (meshtrain's "
                    "vocabulary-parallel embedding); meshtrain was written against libtorch 1.13");
    fallthrough = std::make_unique<torch::Library>(torch::Library::IMPL, "_", kBeforeAutograd, __FILE__, __LINE__);
    fallthrough->fallback(torch::CppFunction::makeFallthrough());
    kernels = std::make_unique<torch::Library>(torch::Library::IMPL, "aten", kBeforeAutograd, __FILE__, __LINE__);
    kernels->impl("embedding", TORCH_FN(vocab_parallel_embedding));
  });
}

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

const char* style_name(Style style) {
  return style == Style::kColwise ? "kColwise" : style == Style::kRowwise ? "kRowwise" : "kVocabParallel";
}

// The layer at `path`, checked against its style before anything is changed.
torch::nn::Module& layer_at(torch::nn::Module& model, const std::string& path, Style style, int tp) {
  for (const auto& item : model.named_modules("", /*include_self=*/false)) {
    if (item.key() != path) continue;
    torch::nn::Module& m = *item.value();
    if (style == Style::kVocabParallel) {
      auto* e = m.as<torch::nn::EmbeddingImpl>();
      MESHTRAIN_CHECK(e, "tp::parallelize: '", path, "' is a ", m.name(), "; kVocabParallel applies to torch::nn::Embedding");
      MESHTRAIN_CHECK(!e->options.max_norm(), "tp::parallelize: Embedding '", path, "' has max_norm, which renormalizes "
                      "rows by global index; build it without max_norm");
      MESHTRAIN_CHECK(e->weight.size(0) >= tp, "tp::parallelize: Embedding '", path, "' has ", e->weight.size(0),
                      " rows, fewer than tp ", tp);
      check_tied_head(model, path, e->weight, tp);
      return m;
    }
    auto* linear = m.as<torch::nn::LinearImpl>();
    MESHTRAIN_CHECK(linear, "tp::parallelize: '", path, "' is a ", m.name(), "; ", style_name(style),
                    " applies to torch::nn::Linear (and kVocabParallel to torch::nn::Embedding)");
    const int64_t dim = style == Style::kColwise ? 0 : 1, full = linear->weight.size(dim);
    MESHTRAIN_CHECK(full % tp == 0, "tp::parallelize: '", path, "' has ", full,
                    style == Style::kColwise ? " output" : " input", " features, which tp ", tp, " does not divide");
    // The sliced dimension is recognised by (stride, size); only a 1 x 1 slice
    // looks the same as its transpose.
    MESHTRAIN_CHECK(full / tp > 1 || linear->weight.size(1 - dim) > 1, "tp::parallelize: '", path, "' would keep a "
                    "1 x 1 slice, which cannot be told from its transpose; leave such a small layer dense");
    return m;
  }
  std::string paths;
  for (const auto& item : model.named_modules("", false))
    if (item.value()->as<torch::nn::LinearImpl>() || item.value()->as<torch::nn::EmbeddingImpl>())
      paths += (paths.empty() ? "" : ", ") + item.key();
  throw ConfigError(str_cat("tp::parallelize: the model has no layer '", path, "'; its Linear and Embedding layers are [",
                            paths, "]"));
}

void slice_linear(torch::nn::LinearImpl& linear, Style style, const comm::CommPtr& tp) {
  at::Tensor& w = linear.weight;
  const int64_t dim = style == Style::kColwise ? 0 : 1, local = w.size(dim) / tp->size(), start = local * tp->rank();
  at::NoGradGuard no_grad;
  w.set_data(w.narrow(dim, start, local).clone());  // the same parameter tensor, resized
  if (style == Style::kColwise && linear.bias.defined()) linear.bias.set_data(linear.bias.narrow(0, start, local).clone());
  intercept::mark(w, std::make_shared<Slice>(tp, w.stride(dim), w.size(dim)));  // after set_data, which copies key sets
}

// A head tied to the embedding multiplies by the same rows: its logits are
// this rank's vocabulary (for tp::vocab_parallel_cross_entropy), and the
// product of its backward that contracts over the rows is summed over tp by a
// Slice of dimension 0, as for a kColwise weight.
void slice_embedding(torch::nn::EmbeddingImpl& embedding, const comm::CommPtr& tp, bool tied) {
  install_embedding_kernel_once();
  at::Tensor& w = embedding.weight;
  const Range rows = shard_range(w.size(0), tp->size(), tp->rank());  // sizes need not divide
  at::NoGradGuard no_grad;
  w.set_data(w.narrow(0, rows.offset, rows.size).clone());
  // libtorch's functional checks padding_idx against the weight's (now local)
  // rows before dispatch: the global index moves into the kernel's record.
  const int64_t padding_idx = embedding.options.padding_idx().value_or(-1);
  embedding.options.padding_idx(c10::nullopt);
  intercept::mark(w, std::make_shared<VocabRows>(tp, rows, padding_idx));
  if (tied) intercept::mark(w, std::make_shared<Slice>(tp, w.stride(0), w.size(0)));
  intercept::add_dispatch_key(w, kBeforeAutograd);
}

// One entry of the plan, checked: the layer at `path` and how it is cut.
struct PlannedLayer {
  std::string path;
  torch::nn::Module* module;
  Style style;
  const at::Tensor& weight() const {
    auto* e = module->as<torch::nn::EmbeddingImpl>();
    return e ? e->weight : module->as<torch::nn::LinearImpl>()->weight;
  }
};

// A head tied to a kVocabParallel embedding follows it: in the plan too, its
// weight would be cut twice.
void refuse_tied_head_in_plan(const std::vector<PlannedLayer>& layers) {
  for (const PlannedLayer& embedding : layers) {
    if (embedding.style != Style::kVocabParallel) continue;
    for (const PlannedLayer& other : layers) {
      MESHTRAIN_CHECK(&other == &embedding || !other.weight().is_same(embedding.weight()), "tp::parallelize: '",
                      other.path, "' shares its weight with the kVocabParallel Embedding '", embedding.path,
                      "' (tied): leave it out of the plan, it is cut with the embedding");
    }
  }
}

}  // namespace

void parallelize(torch::nn::Module& model, const comm::CommPtr& tp, const std::map<std::string, Style>& plan) {
  MESHTRAIN_CHECK(tp, "tp::parallelize needs a communicator");
  std::vector<PlannedLayer> layers;
  for (const auto& kv : plan) layers.push_back({kv.first, &layer_at(model, kv.first, kv.second, tp->size()), kv.second});
  refuse_tied_head_in_plan(layers);  // all checked before anything changes
  if (tp->size() == 1) return;
  for (const PlannedLayer& l : layers) {
    if (l.style == Style::kVocabParallel) {
      auto& e = *l.module->as<torch::nn::EmbeddingImpl>();
      slice_embedding(e, tp, /*tied=*/!tied_to(model, l.path, e.weight).empty());
    } else {
      slice_linear(*l.module->as<torch::nn::LinearImpl>(), l.style, tp);
    }
  }
}

}  // namespace tp
}  // namespace meshtrain
