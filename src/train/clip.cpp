#include "meshtrain/train.h"

#include <ATen/ATen.h>

#include <cmath>

#include "meshtrain/dp.h"
#include "tp/shards.h"
#include "util/exact_sum.h"

namespace meshtrain {
namespace train {

namespace {

// torch.nn.utils.clip_grad_norm_'s scaling, given the global norm.
double scale_to(const std::vector<GradPart>& parts, double max_norm, double norm) {
  if (max_norm > 0 && std::isfinite(norm)) {
    const double coef = max_norm / (norm + 1e-6);
    if (coef < 1.0) {
      at::NoGradGuard no_grad;
      for (const auto& p : parts)
        if (p.grad.defined()) p.grad.mul_(coef);
    }
  }
  return norm;
}

bool counts(const GradPart& p) { return p.counted && p.grad.defined() && p.grad.numel() > 0; }

}  // namespace

double clip_grad_norm(const std::vector<GradPart>& parts, double max_norm, comm::Communicator& group) {
  at::Tensor sum_sq = at::zeros({1}, at::kDouble);
  for (const auto& p : parts)
    if (counts(p)) sum_sq += at::linalg_vector_norm(p.grad, 2, c10::nullopt, false, at::kDouble).square();
  group.all_reduce(sum_sq);
  return scale_to(parts, max_norm, std::sqrt(sum_sq.item<double>()));
}

double clip_grad_norm_exact(const std::vector<GradPart>& parts, double max_norm, comm::Communicator& group) {
  ExactSquareSum mine;
  for (const auto& p : parts)
    if (counts(p)) mine.add_squares(p.grad);
  at::Tensor digits = mine.digits();
  group.all_reduce(digits);  // integers: the same sum in any order
  return scale_to(parts, max_norm, std::sqrt(ExactSquareSum::from_digits(digits).value()));
}

std::vector<GradPart> count_once(const NamedGrads& grads, const std::map<std::string, int64_t>& tp_dims,
                                 bool replicated_over_dp, const mesh::Coord& at) {
  std::vector<GradPart> parts;
  const bool dp_counts = !replicated_over_dp || (at.dp == 0 && at.cp == 0);  // cp ranks are replicas too
  for (const auto& g : grads) {
    auto dim = tp_dims.find(g.first);
    const bool split = dim != tp_dims.end() && dim->second >= 0;
    parts.push_back({g.second, dp_counts && (split || at.tp == 0)});
  }
  return parts;
}

double clip_grad_norm(const torch::nn::Module& module, double max_norm, const mesh::DeviceMesh& mesh) {
  NamedGrads grads;
  for (const auto& p : dp::unique_parameters(module)) grads.emplace_back(p.name, p.tensor.grad());
  return clip_grad_norm(count_once(grads, tp::shard_dims(module), true, mesh.coord()), max_norm, *mesh.world());
}

}  // namespace train
}  // namespace meshtrain
