// Dense <-> sharded parameters: see the header.
#include "tp/shards.h"

#include <ATen/ATen.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>

#include "meshtrain/tp.h"
#include "util/shard.h"

namespace meshtrain {
namespace tp {

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
