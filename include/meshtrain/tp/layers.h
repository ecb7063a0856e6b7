#pragma once
// Tensor-parallel layers (Megatron-style). With no tp communicator (or one of
// size 1) each is exactly its dense counterpart, so models are written once.
// Every parameter is initialized from the unsharded tensor's deterministic
// values (util/init.h), sliced: every tp degree starts from the same model.
//
//   ColumnParallelLinear  Y = X W^T + b, W [out, in] split by output rows:
//                         rank r holds W[r*out/tp : (r+1)*out/tp, :]
//   RowParallelLinear     Y = X W^T + b, W [out, in] split by input columns:
//                         rank r holds W[:, r*in/tp : (r+1)*in/tp]; partial
//                         outputs are summed across tp (b added once)
//   VocabParallelEmbedding  E [vocab, dim] split by rows; each rank looks up
//                         its range, zeros elsewhere, summed across tp
//
// Two ways to get the values: from a dense layer the user already built
// (column_parallel / row_parallel / vocab_parallel below: the TP model and its
// dense twin start equal by construction), or from seed + name (the built-in
// models); then the name is required, since two layers of one shape and one
// name would start identical.

#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <map>

#include "meshtrain/comm/communicator.h"
#include "meshtrain/util/init.h"

namespace meshtrain {
namespace tp {

int tp_size(const comm::CommPtr& tp);
int tp_rank(const comm::CommPtr& tp);

// Where a parameter's values come from: the seed, its full name, its spec.
struct ParamSource {
  uint64_t seed = 0;
  std::string name;
  InitSpec spec;
};

struct ColumnParallelLinearOptions {
  ColumnParallelLinearOptions(int64_t in_features, int64_t out_features)
      : in_features_(in_features), out_features_(out_features) {}
  TORCH_ARG(int64_t, in_features);
  TORCH_ARG(int64_t, out_features);
  TORCH_ARG(bool, bias) = true;
  // All-gather the output so every rank gets all out_features.
  TORCH_ARG(bool, gather_output) = false;
  // Input is split along the sequence (dim 1) and all-gathered first.
  TORCH_ARG(bool, sequence_parallel) = false;
  // The caller already applied copy_to_tp / gather_from_sp to the input (several
  // layers reading one input share that one communication, e.g. q, k and v).
  TORCH_ARG(bool, input_is_prepared) = false;
  TORCH_ARG(comm::CommPtr, tp) = nullptr;
  TORCH_ARG(uint64_t, seed) = 0;
  // Prefix of the parameters' full names ("blocks.0.attn.q"): seeds their
  // values. Required (see above).
  TORCH_ARG(std::string, name) = "";
  TORCH_ARG(InitSpec, weight_init) = InitSpec::normal(0, 0.02);
  TORCH_ARG(InitSpec, bias_init) = InitSpec::constant(0);
};

class ColumnParallelLinearImpl : public torch::nn::Module {
 public:
  explicit ColumnParallelLinearImpl(ColumnParallelLinearOptions options);
  at::Tensor forward(const at::Tensor& input);
  ColumnParallelLinearOptions options;
  at::Tensor weight;  // [out/tp, in]
  at::Tensor bias;    // [out/tp] or undefined
};
TORCH_MODULE(ColumnParallelLinear);

struct RowParallelLinearOptions {
  RowParallelLinearOptions(int64_t in_features, int64_t out_features)
      : in_features_(in_features), out_features_(out_features) {}
  TORCH_ARG(int64_t, in_features);
  TORCH_ARG(int64_t, out_features);
  TORCH_ARG(bool, bias) = true;
  // The input already holds this rank's in_features/tp slice (the output of a
  // ColumnParallelLinear); otherwise it is split here.
  TORCH_ARG(bool, input_is_parallel) = true;
  // Reduce-scatter the output along the sequence (dim 1) instead of all-reducing it.
  TORCH_ARG(bool, sequence_parallel) = false;
  TORCH_ARG(comm::CommPtr, tp) = nullptr;
  TORCH_ARG(uint64_t, seed) = 0;
  TORCH_ARG(std::string, name) = "";  // required, as ColumnParallelLinearOptions::name
  TORCH_ARG(InitSpec, weight_init) = InitSpec::normal(0, 0.02);
  TORCH_ARG(InitSpec, bias_init) = InitSpec::constant(0);
};

class RowParallelLinearImpl : public torch::nn::Module {
 public:
  explicit RowParallelLinearImpl(RowParallelLinearOptions options);
  at::Tensor forward(const at::Tensor& input);
  RowParallelLinearOptions options;
  at::Tensor weight;  // [out, in/tp]
  at::Tensor bias;    // [out] (replicated) or undefined
};
TORCH_MODULE(RowParallelLinear);

struct VocabParallelEmbeddingOptions {
  VocabParallelEmbeddingOptions(int64_t num_embeddings, int64_t embedding_dim)
      : num_embeddings_(num_embeddings), embedding_dim_(embedding_dim) {}
  TORCH_ARG(int64_t, num_embeddings);
  TORCH_ARG(int64_t, embedding_dim);
  TORCH_ARG(comm::CommPtr, tp) = nullptr;
  // Reduce-scatter the output along the sequence instead of all-reducing it.
  TORCH_ARG(bool, sequence_parallel) = false;
  TORCH_ARG(uint64_t, seed) = 0;
  TORCH_ARG(std::string, name) = "";  // required, as ColumnParallelLinearOptions::name
  TORCH_ARG(InitSpec, weight_init) = InitSpec::normal(0, 0.02);
};

class VocabParallelEmbeddingImpl : public torch::nn::Module {
 public:
  explicit VocabParallelEmbeddingImpl(VocabParallelEmbeddingOptions options);
  at::Tensor forward(const at::Tensor& ids);
  VocabParallelEmbeddingOptions options;
  at::Tensor weight;  // [vocab/tp, dim]
  int64_t vocab_start = 0, vocab_end = 0;  // this rank's rows of the full vocabulary
};
TORCH_MODULE(VocabParallelEmbedding);

// This rank's slice of a dense layer the user built (every tp rank passes the
// same values; build it after the same seed): the parallel layer computes what
// `dense` computes. Options other than sizes, bias and tp keep their defaults;
// pass `options` to set them (its sizes and tp are checked against `dense`).
ColumnParallelLinear column_parallel(const torch::nn::Linear& dense, comm::CommPtr tp);
ColumnParallelLinear column_parallel(const torch::nn::Linear& dense, ColumnParallelLinearOptions options);
RowParallelLinear row_parallel(const torch::nn::Linear& dense, comm::CommPtr tp);
RowParallelLinear row_parallel(const torch::nn::Linear& dense, RowParallelLinearOptions options);
VocabParallelEmbedding vocab_parallel(const torch::nn::Embedding& dense, comm::CommPtr tp);

// A parameter shard initialized from the full tensor's deterministic values:
// rows/cols [start, start + length) along `dim` of `full_shape`.
at::Tensor make_shard(const ParamSource& source, const std::vector<int64_t>& full_shape, int64_t dim,
                      int64_t start, int64_t length);

// LayerNorm inside a sequence-parallel region: each rank normalizes its part
// of the sequence, so its weight and bias get partial gradients; routing them
// through copy_to_tp sums those over tp. Outside SP: the plain LayerNorm.
at::Tensor layer_norm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                      const comm::CommPtr& tp, bool sequence_parallel);

// Dense <-> sharded parameters. shard_dims gives, for each parameter of a
// module built from these layers or cut by tp::parallelize, the dimension it
// is split along (-1: replicated on every tp rank).
std::map<std::string, int64_t> shard_dims(const torch::nn::Module& module);
// The full tensors from every tp rank's shards (a collective over tp).
std::map<std::string, at::Tensor> unshard(const std::map<std::string, at::Tensor>& local,
                                          const std::map<std::string, int64_t>& dims, comm::Communicator& tp);
// This rank's shards of full tensors.
std::map<std::string, at::Tensor> shard(const std::map<std::string, at::Tensor>& full,
                                        const std::map<std::string, int64_t>& dims, int tp_rank, int tp_size);

}  // namespace tp
}  // namespace meshtrain
