#include "meshtrain/tp/layers.h"

#include <ATen/ATen.h>
#include <torch/nn/functional.h>

#include "meshtrain/util/error.h"

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

void require_dense(const comm::CommPtr& tp, const char* layer) {
  MESHTRAIN_CHECK(tp_size(tp) == 1, layer, ": tensor parallelism (tp > 1) is not implemented yet");
}

}  // namespace

ColumnParallelLinearImpl::ColumnParallelLinearImpl(ColumnParallelLinearOptions opts) : options(std::move(opts)) {
  const auto& o = options;
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
  require_dense(options.tp(), "ColumnParallelLinear");
  return at::linear(input, weight, bias);
}

RowParallelLinearImpl::RowParallelLinearImpl(RowParallelLinearOptions opts) : options(std::move(opts)) {
  const auto& o = options;
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
  require_dense(options.tp(), "RowParallelLinear");
  return at::linear(input, weight, bias);
}

VocabParallelEmbeddingImpl::VocabParallelEmbeddingImpl(VocabParallelEmbeddingOptions opts) : options(std::move(opts)) {
  const auto& o = options;
  const int64_t local = split_size(o.num_embeddings(), o.tp(), "the vocabulary size",
                                   "VocabParallelEmbedding '" + o.name() + "'");
  vocab_start = local * tp_rank(o.tp());
  vocab_end = vocab_start + local;
  weight = register_parameter("weight", make_shard({o.seed(), o.name() + ".weight", o.weight_init()},
                                                   {o.num_embeddings(), o.embedding_dim()}, 0, vocab_start, local));
}

at::Tensor VocabParallelEmbeddingImpl::forward(const at::Tensor& ids) {
  require_dense(options.tp(), "VocabParallelEmbedding");
  return at::embedding(weight, ids);
}

}  // namespace tp
}  // namespace meshtrain
