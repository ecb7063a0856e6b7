#include "meshtrain/tp/parallelize.h"

#include <ATen/ATen.h>
#include <torch/nn/modules/linear.h>

#include "meshtrain/util/error.h"
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

torch::nn::LinearImpl& linear_at(torch::nn::Module& model, const std::string& path) {
  for (const auto& item : model.named_modules("", /*include_self=*/false)) {
    if (item.key() != path) continue;
    auto* linear = item.value()->as<torch::nn::LinearImpl>();
    MESHTRAIN_CHECK(linear, "tp::parallelize: '", path, "' is a ", item.value()->name(),
                    "; the plan may name torch::nn::Linear layers only");
    return *linear;
  }
  std::string paths;
  for (const auto& item : model.named_modules("", false))
    if (item.value()->as<torch::nn::LinearImpl>()) paths += (paths.empty() ? "" : ", ") + item.key();
  throw ConfigError(str_cat("tp::parallelize: the model has no layer '", path, "'; its Linear layers are [", paths, "]"));
}

void slice_linear(torch::nn::LinearImpl& linear, const std::string& path, Style style, const comm::CommPtr& tp) {
  at::Tensor& w = linear.weight;
  const int64_t dim = style == Style::kColwise ? 0 : 1, n = tp->size(), full = w.size(dim);
  MESHTRAIN_CHECK(full % n == 0, "tp::parallelize: '", path, "' has ", full,
                  style == Style::kColwise ? " output" : " input", " features, which tp ", n, " does not divide");
  const int64_t local = full / n, start = local * tp->rank();
  // The sliced dimension is recognised by (stride, size); only a 1 x 1 slice
  // looks the same as its transpose.
  MESHTRAIN_CHECK(local > 1 || w.size(1 - dim) > 1, "tp::parallelize: '", path, "' would keep a 1 x 1 slice, which "
                  "cannot be told from its transpose; leave such a small layer dense");
  at::NoGradGuard no_grad;
  w.set_data(w.narrow(dim, start, local).clone());  // the same parameter tensor, resized
  if (style == Style::kColwise && linear.bias.defined()) linear.bias.set_data(linear.bias.narrow(0, start, local).clone());
  intercept::mark(w, std::make_shared<Slice>(tp, w.stride(dim), w.size(dim)));  // after set_data, which copies key sets
}

}  // namespace

void parallelize(torch::nn::Module& model, const comm::CommPtr& tp, const std::map<std::string, Style>& plan) {
  MESHTRAIN_CHECK(tp, "tp::parallelize needs a communicator");
  std::vector<std::pair<torch::nn::LinearImpl*, std::pair<std::string, Style>>> layers;
  for (const auto& kv : plan) layers.push_back({&linear_at(model, kv.first), kv});  // every path checked first
  if (tp->size() == 1) return;
  for (auto& l : layers) slice_linear(*l.first, l.second.first, l.second.second, tp);
}

}  // namespace tp
}  // namespace meshtrain
