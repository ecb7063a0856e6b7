#include "train/mixed_precision.h"

#include <ATen/ATen.h>

#include "util/intercept.h"

namespace meshtrain {
namespace train {

bool bf16_products_accumulate_in_float() {  // Note [bf16 products on hosts without AVX-512]
  static const bool in_float = [] {
    at::NoGradGuard no_grad;
    // Both operands contiguous: the layout whose loop accumulates in bf16
    // (with the second transposed, libtorch 1.13's loop adds in float).
    const at::Tensor product = at::mm(at::ones({2, 4096}, at::kBFloat16), at::ones({4096, 2}, at::kBFloat16));
    return product.to(at::kFloat).eq(4096.0f).all().item<bool>();
  }();
  return in_float;
}

void cast_parameters(torch::nn::Module& module, at::ScalarType dtype) {
  at::NoGradGuard no_grad;
  for (auto& p : dp::unique_parameters(module))
    if (p.tensor.is_floating_point()) intercept::set_data_keeping_marks(p.tensor, p.tensor.detach().to(dtype));
}

MasterWeights::MasterWeights(torch::nn::Module& module, at::ScalarType compute) {
  model_ = dp::unique_parameters(module);
  for (auto& p : model_)
    masters_.push_back({p.name, p.tensor.detach().to(at::kFloat, false, /*copy=*/true).requires_grad_(true)});
  cast_parameters(module, compute);
}

std::vector<at::Tensor> MasterWeights::parameters() const {
  std::vector<at::Tensor> out;
  for (const auto& m : masters_) out.push_back(m.tensor);
  return out;
}

void MasterWeights::gradients_to_masters() {
  for (size_t i = 0; i < model_.size(); ++i) {
    const at::Tensor& g = model_[i].tensor.grad();
    masters_[i].tensor.mutable_grad() = g.defined() ? g.to(at::kFloat) : at::Tensor();
  }
}

void MasterWeights::masters_to_parameters() {
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < model_.size(); ++i) {
    model_[i].tensor.copy_(masters_[i].tensor);
    masters_[i].tensor.mutable_grad() = at::Tensor();  // float32 gradients live for the step only
  }
}

void MasterWeights::zero_model_grad() {
  for (auto& p : model_) p.tensor.mutable_grad() = at::Tensor();
}

int64_t MasterWeights::master_bytes() const {
  int64_t n = 0;
  for (const auto& m : masters_) n += m.tensor.nbytes();
  return n;
}

}  // namespace train
}  // namespace meshtrain
