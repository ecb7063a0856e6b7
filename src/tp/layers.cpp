#include "meshtrain/tp/layers.h"

#include <ATen/ATen.h>
#include <torch/nn/functional.h>

#include "meshtrain/tp/ops.h"
#include "meshtrain/tp/parallelize.h"
#include "meshtrain/util/error.h"
#include "meshtrain/util/shard.h"

namespace meshtrain {
namespace tp {

int tp_size(const comm::CommPtr& tp) { return tp ? tp->size() : 1; }
int tp_rank(const comm::CommPtr& tp) { return tp ? tp->rank() : 0; }

at::Tensor make_shard(const ParamSource& source, const std::vector<int64_t>& full_shape, int64_t dim,
                      int64_t start, int64_t length) {
  return init_slice(source.seed, source.name, source.spec, full_shape, dim, start, length);
}

namespace {

// Splits `total` features evenly over tp; errors name the values and the valid choices.
int64_t split_size(int64_t total, const comm::CommPtr& tp, const std::string& what, const std::string& layer) {
  const int n = tp_size(tp);
  if (total % n != 0) {
    std::string valid;
    for (int d = 1; d <= total && d <= 64; ++d)
      if (total % d == 0) valid += (valid.empty() ? "" : ", ") + std::to_string(d);
    throw ConfigError(str_cat(layer, ": tp size ", n, " does not divide ", what, " ", total,
                              "; choose tp in {", valid, "}"));
  }
  return total / n;
}

// Values derive from seed + name: an unnamed layer would start like every other
// unnamed layer of its shape.
void require_name(const std::string& name, const char* layer) {
  MESHTRAIN_CHECK(!name.empty(), layer, ": give it a name (.name(\"blocks.0.mlp.fc1\")), from which its initial "
                  "values derive, or build it from a dense layer (tp::column_parallel / row_parallel / vocab_parallel)");
}

// The dense layer's values replace the seeded ones (the name only had to be unique).
constexpr const char* kFromDense = "(values of a dense layer)";

void copy_slice(at::Tensor& shard, const at::Tensor& full, int64_t dim, int64_t start) {
  at::NoGradGuard no_grad;
  shard.copy_(full.narrow(dim, start, shard.size(dim)));
}

void check_same_sizes(int64_t in, int64_t out, const torch::nn::Linear& dense, const char* layer) {
  MESHTRAIN_CHECK(dense->options.in_features() == in && dense->options.out_features() == out, layer,
                  ": the options say ", in, " -> ", out, " features, the dense layer ",
                  dense->options.in_features(), " -> ", dense->options.out_features());
}

}  // namespace

ColumnParallelLinear column_parallel(const torch::nn::Linear& dense, ColumnParallelLinearOptions options) {
  check_same_sizes(options.in_features(), options.out_features(), dense, "tp::column_parallel");
  if (options.name().empty()) options.name(kFromDense);
  options.bias(dense->bias.defined());
  ColumnParallelLinear layer(options);
  const int64_t start = layer->weight.size(0) * tp_rank(options.tp());
  copy_slice(layer->weight, dense->weight, 0, start);
  if (layer->bias.defined()) copy_slice(layer->bias, dense->bias, 0, start);
  return layer;
}

ColumnParallelLinear column_parallel(const torch::nn::Linear& dense, comm::CommPtr tp) {
  return column_parallel(dense, ColumnParallelLinearOptions(dense->options.in_features(), dense->options.out_features())
                                    .tp(std::move(tp)));
}

RowParallelLinear row_parallel(const torch::nn::Linear& dense, RowParallelLinearOptions options) {
  check_same_sizes(options.in_features(), options.out_features(), dense, "tp::row_parallel");
  if (options.name().empty()) options.name(kFromDense);
  options.bias(dense->bias.defined());
  RowParallelLinear layer(options);
  copy_slice(layer->weight, dense->weight, 1, layer->weight.size(1) * tp_rank(options.tp()));
  if (layer->bias.defined()) copy_slice(layer->bias, dense->bias, 0, 0);  // replicated
  return layer;
}

RowParallelLinear row_parallel(const torch::nn::Linear& dense, comm::CommPtr tp) {
  return row_parallel(dense, RowParallelLinearOptions(dense->options.in_features(), dense->options.out_features())
                                 .tp(std::move(tp)));
}

VocabParallelEmbedding vocab_parallel(const torch::nn::Embedding& dense, comm::CommPtr tp) {
  VocabParallelEmbedding layer(VocabParallelEmbeddingOptions(dense->options.num_embeddings(),
                                                             dense->options.embedding_dim())
                                   .tp(std::move(tp))
                                   .name(kFromDense));
  copy_slice(layer->weight, dense->weight, 0, layer->vocab_start);
  return layer;
}

ColumnParallelLinearImpl::ColumnParallelLinearImpl(ColumnParallelLinearOptions opts) : options(std::move(opts)) {
  const auto& o = options;
  require_name(o.name(), "ColumnParallelLinear");
  const int64_t local = split_size(o.out_features(), o.tp(), "out_features", "ColumnParallelLinear '" + o.name() + "'");
  const int64_t start = local * tp_rank(o.tp());
  weight = register_parameter("weight", make_shard({o.seed(), o.name() + ".weight", o.weight_init()},
                                                   {o.out_features(), o.in_features()}, 0, start, local));
  if (o.bias()) {
    bias = register_parameter("bias", make_shard({o.seed(), o.name() + ".bias", o.bias_init()},
                                                 {o.out_features()}, 0, start, local));
  }
}

at::Tensor ColumnParallelLinearImpl::forward(const at::Tensor& input) {
  const auto& tp = options.tp();
  at::Tensor x = input;
  if (!options.input_is_prepared()) x = options.sequence_parallel() ? gather_from_sp(input, tp) : copy_to_tp(input, tp);
  at::Tensor y = at::linear(x, weight, bias);
  return options.gather_output() ? gather_from_tp(y, -1, tp) : y;
}

RowParallelLinearImpl::RowParallelLinearImpl(RowParallelLinearOptions opts) : options(std::move(opts)) {
  const auto& o = options;
  require_name(o.name(), "RowParallelLinear");
  const int64_t local = split_size(o.in_features(), o.tp(), "in_features", "RowParallelLinear '" + o.name() + "'");
  weight = register_parameter("weight", make_shard({o.seed(), o.name() + ".weight", o.weight_init()},
                                                   {o.out_features(), o.in_features()}, 1,
                                                   local * tp_rank(o.tp()), local));
  if (o.bias()) {
    bias = register_parameter("bias", make_shard({o.seed(), o.name() + ".bias", o.bias_init()},
                                                 {o.out_features()}, 0, 0, o.out_features()));
  }
}

at::Tensor RowParallelLinearImpl::forward(const at::Tensor& input) {
  const auto& tp = options.tp();
  if (tp_size(tp) == 1) return at::linear(input, weight, bias);
  at::Tensor x = options.input_is_parallel() ? input : scatter_to_tp(input, -1, tp);
  at::Tensor partial = at::linear(x, weight);  // this rank's share of the sum over input features
  at::Tensor y = options.sequence_parallel() ? reduce_scatter_to_sp(partial, tp) : reduce_from_tp(partial, tp);
  if (!bias.defined()) return y;
  // Under sequence parallelism each rank adds the bias to its part of the
  // sequence only, so the bias gradients are partial: copy_to_tp sums them.
  return y + (options.sequence_parallel() ? copy_to_tp(bias, tp) : bias);
}

VocabParallelEmbeddingImpl::VocabParallelEmbeddingImpl(VocabParallelEmbeddingOptions opts) : options(std::move(opts)) {
  const auto& o = options;
  require_name(o.name(), "VocabParallelEmbedding");
  const int64_t local = split_size(o.num_embeddings(), o.tp(), "the vocabulary size",
                                   "VocabParallelEmbedding '" + o.name() + "'");
  vocab_start = local * tp_rank(o.tp());
  vocab_end = vocab_start + local;
  weight = register_parameter("weight", make_shard({o.seed(), o.name() + ".weight", o.weight_init()},
                                                   {o.num_embeddings(), o.embedding_dim()}, 0, vocab_start, local));
}

at::Tensor VocabParallelEmbeddingImpl::forward(const at::Tensor& ids) {
  const auto& tp = options.tp();
  if (tp_size(tp) == 1) return at::embedding(weight, ids);
  // Each rank masks the ids outside its range, so an id outside every range
  // would become a zero row without a word: refused as at::embedding does.
  if (ids.numel() > 0) {
    const int64_t lowest = ids.min().item<int64_t>(), highest = ids.max().item<int64_t>();
    MESHTRAIN_CHECK(lowest >= 0 && highest < options.num_embeddings(), "VocabParallelEmbedding '", options.name(),
                    "': token id ", lowest < 0 ? lowest : highest, " is outside the vocabulary [0, ",
                    options.num_embeddings(), ")");
  }
  // Look up the ids in this rank's range; the others give zero rows; the sum
  // over tp is the full embedding.
  at::Tensor outside = (ids < vocab_start) | (ids >= vocab_end);
  at::Tensor local = (ids - vocab_start).masked_fill(outside, 0);
  at::Tensor out = at::embedding(weight, local).masked_fill(outside.unsqueeze(-1), 0.0);
  return options.sequence_parallel() ? reduce_scatter_to_sp(out, tp) : reduce_from_tp(out, tp);
}

at::Tensor layer_norm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, const comm::CommPtr& tp,
                      bool sequence_parallel) {
  const bool partial = sequence_parallel && tp_size(tp) > 1;
  return at::layer_norm(x, {x.size(-1)}, partial ? copy_to_tp(weight, tp) : weight, partial ? copy_to_tp(bias, tp) : bias);
}

std::map<std::string, int64_t> shard_dims(const torch::nn::Module& module) {
  std::map<std::string, int64_t> dims;
  for (const auto& p : module.named_parameters()) dims[p.key()] = sliced_dim(p.value());  // tp::parallelize's
  for (const auto& m : module.named_modules()) {
    const std::string prefix = m.key().empty() ? "" : m.key() + ".";
    // Layers cut by tp::parallelize, also when zero::fully_shard has taken
    // their parameters out of the module's list (the layers keep them).
    auto cut = [&](const std::string& name, const at::Tensor& t) {
      if (t.defined() && sliced_dim(t) >= 0) dims[prefix + name] = sliced_dim(t);
    };
    if (auto* l = dynamic_cast<torch::nn::LinearImpl*>(m.value().get())) cut("weight", l->weight), cut("bias", l->bias);
    if (auto* e = dynamic_cast<torch::nn::EmbeddingImpl*>(m.value().get())) cut("weight", e->weight);
    if (auto* c = dynamic_cast<ColumnParallelLinearImpl*>(m.value().get())) {
      dims[prefix + "weight"] = 0;
      if (c->bias.defined()) dims[prefix + "bias"] = 0;
    } else if (dynamic_cast<RowParallelLinearImpl*>(m.value().get())) {
      dims[prefix + "weight"] = 1;
    } else if (dynamic_cast<VocabParallelEmbeddingImpl*>(m.value().get())) {
      dims[prefix + "weight"] = 0;
    }
  }
  return dims;
}

namespace {

// The full tensor from every tp rank's part along `dim`. Parts may differ in
// size (a vocabulary tp does not divide, cut by shard_range): the sizes are
// exchanged first and the parts padded to the largest for the all-gather.
at::Tensor gather_parts(const at::Tensor& part, int64_t dim, comm::Communicator& tp) {
  const at::Tensor sizes = all_gather_along(at::tensor({part.size(dim)}, at::kLong), 0, tp);
  const int64_t most = sizes.max().item<int64_t>();
  if (sizes.min().item<int64_t>() == most) return all_gather_along(part, dim, tp);
  std::vector<int64_t> padded_shape = part.sizes().vec();
  padded_shape[dim] = most;
  at::Tensor padded = at::zeros(padded_shape, part.options());
  padded.narrow(dim, 0, part.size(dim)).copy_(part);
  const at::Tensor all = all_gather_along(padded, dim, tp);
  std::vector<at::Tensor> pieces;
  for (int r = 0; r < tp.size(); ++r) pieces.push_back(all.narrow(dim, r * most, sizes[r].item<int64_t>()));
  return at::cat(pieces, dim);
}

}  // namespace

std::map<std::string, at::Tensor> unshard(const std::map<std::string, at::Tensor>& local,
                                          const std::map<std::string, int64_t>& dims, comm::Communicator& tp) {
  std::map<std::string, at::Tensor> full;
  for (const auto& kv : local) {  // same names in the same order on every tp rank
    auto it = dims.find(kv.first);
    const int64_t dim = it == dims.end() ? -1 : it->second;
    full[kv.first] = dim < 0 || tp.size() == 1 ? kv.second : gather_parts(kv.second, dim, tp);
  }
  return full;
}

std::map<std::string, at::Tensor> shard(const std::map<std::string, at::Tensor>& full,
                                        const std::map<std::string, int64_t>& dims, int tp_rank, int tp_size) {
  std::map<std::string, at::Tensor> out;
  for (const auto& kv : full) {
    auto it = dims.find(kv.first);
    const int64_t dim = it == dims.end() ? -1 : it->second;
    if (dim < 0 || tp_size == 1) {
      out[kv.first] = kv.second;
      continue;
    }
    const Range part = shard_range(kv.second.size(dim), tp_size, tp_rank);  // as tp::parallelize cuts (even: chunk)
    out[kv.first] = kv.second.narrow(dim, part.offset, part.size).contiguous();
  }
  return out;
}

}  // namespace tp
}  // namespace meshtrain
