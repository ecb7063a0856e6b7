#include "meshtrain/tp.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include "meshtrain/util.h"

namespace meshtrain {
namespace tp {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

bool trivial(const comm::CommPtr& tp) { return !tp || tp->size() == 1; }

// The communicator travels through the autograd context as an address; it
// outlives the graph (the mesh owns it for the whole run).
int64_t handle(const comm::CommPtr& c) { return reinterpret_cast<int64_t>(c.get()); }
comm::Communicator& comm_of(AutogradContext* ctx) {
  return *reinterpret_cast<comm::Communicator*>(ctx->saved_data["comm"].toInt());
}

at::Tensor all_reduce_copy(const at::Tensor& x, comm::Communicator& c) {
  at::Tensor y = x.contiguous().clone();
  c.all_reduce(y);
  return y;
}

struct CopyToTp : public torch::autograd::Function<CopyToTp> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t c) {
    ctx->saved_data["comm"] = c;
    return x.view_as(x);
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) { return {all_reduce_copy(g[0], comm_of(ctx)), at::Tensor()}; }
};

struct ReduceFromTp : public torch::autograd::Function<ReduceFromTp> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t c) {
    return all_reduce_copy(x, *reinterpret_cast<comm::Communicator*>(c));
  }
  static variable_list backward(AutogradContext*, variable_list g) { return {g[0], at::Tensor()}; }
};

struct ScatterToTp : public torch::autograd::Function<ScatterToTp> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t dim, int64_t c) {
    ctx->saved_data["comm"] = c;
    ctx->saved_data["dim"] = dim;
    return split_along(x, dim, *reinterpret_cast<comm::Communicator*>(c));
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    return {all_gather_along(g[0], ctx->saved_data["dim"].toInt(), comm_of(ctx)), at::Tensor(), at::Tensor()};
  }
};

struct GatherFromTp : public torch::autograd::Function<GatherFromTp> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t dim, int64_t c) {
    ctx->saved_data["comm"] = c;
    ctx->saved_data["dim"] = dim;
    return all_gather_along(x, dim, *reinterpret_cast<comm::Communicator*>(c));
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    return {split_along(g[0], ctx->saved_data["dim"].toInt(), comm_of(ctx)), at::Tensor(), at::Tensor()};
  }
};

struct GatherFromSp : public torch::autograd::Function<GatherFromSp> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t c) {
    ctx->saved_data["comm"] = c;
    return all_gather_along(x, 1, *reinterpret_cast<comm::Communicator*>(c));
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    return {reduce_scatter_along(g[0], 1, comm_of(ctx)), at::Tensor()};
  }
};

struct ReduceScatterToSp : public torch::autograd::Function<ReduceScatterToSp> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t c) {
    ctx->saved_data["comm"] = c;
    return reduce_scatter_along(x, 1, *reinterpret_cast<comm::Communicator*>(c));
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    return {all_gather_along(g[0], 1, comm_of(ctx)), at::Tensor()};
  }
};

int64_t normalize(int64_t dim, const at::Tensor& x) { return dim < 0 ? dim + x.dim() : dim; }

}  // namespace

at::Tensor split_along(const at::Tensor& x, int64_t dim, const comm::Communicator& tp) {
  dim = normalize(dim, x);
  MESHTRAIN_CHECK(x.size(dim) % tp.size() == 0, "tensor parallel: dimension ", dim, " of size ", x.size(dim),
                  " does not split over tp ", tp.size());
  return x.chunk(tp.size(), dim)[tp.rank()].contiguous();
}

at::Tensor all_gather_along(const at::Tensor& x, int64_t dim, comm::Communicator& tp) {
  dim = normalize(dim, x);
  std::vector<at::Tensor> parts = tp.all_gather(x.contiguous());
  return at::cat(parts, dim);
}

at::Tensor reduce_scatter_along(const at::Tensor& x, int64_t dim, comm::Communicator& tp) {
  dim = normalize(dim, x);
  MESHTRAIN_CHECK(x.size(dim) % tp.size() == 0, "tensor parallel: dimension ", dim, " of size ", x.size(dim),
                  " does not split over tp ", tp.size(), " (sequence parallelism needs the sequence length divisible "
                  "by tp)");
  // Move `dim` to the front so that each rank's chunk is contiguous in the flat buffer.
  at::Tensor front = x.movedim(dim, 0).contiguous();
  std::vector<int64_t> shape = front.sizes().vec();
  shape[0] /= tp.size();
  at::Tensor out = at::empty(shape, x.options());
  tp.reduce_scatter_into(out, front);
  return out.movedim(0, dim).contiguous();
}

at::Tensor copy_to_tp(const at::Tensor& x, const comm::CommPtr& tp) {
  return trivial(tp) ? x : CopyToTp::apply(x, handle(tp));
}
at::Tensor reduce_from_tp(const at::Tensor& x, const comm::CommPtr& tp) {
  return trivial(tp) ? x : ReduceFromTp::apply(x, handle(tp));
}
at::Tensor scatter_to_tp(const at::Tensor& x, int64_t dim, const comm::CommPtr& tp) {
  return trivial(tp) ? x : ScatterToTp::apply(x, dim, handle(tp));
}
at::Tensor gather_from_tp(const at::Tensor& x, int64_t dim, const comm::CommPtr& tp) {
  return trivial(tp) ? x : GatherFromTp::apply(x, dim, handle(tp));
}
at::Tensor scatter_to_sp(const at::Tensor& x, const comm::CommPtr& tp) { return scatter_to_tp(x, 1, tp); }
at::Tensor gather_from_sp(const at::Tensor& x, const comm::CommPtr& tp) {
  return trivial(tp) ? x : GatherFromSp::apply(x, handle(tp));
}
at::Tensor reduce_scatter_to_sp(const at::Tensor& x, const comm::CommPtr& tp) {
  return trivial(tp) ? x : ReduceScatterToSp::apply(x, handle(tp));
}

namespace {

// softmax - onehot, computed in forward and kept for backward (no communication there).
struct VocabParallelCrossEntropy : public torch::autograd::Function<VocabParallelCrossEntropy> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& logits, const at::Tensor& targets, int64_t c) {
    comm::Communicator& tp = *reinterpret_cast<comm::Communicator*>(c);
    const int64_t local_v = logits.size(1), start = local_v * tp.rank();
    at::Tensor x = logits.detach().to(at::kFloat);
    at::Tensor max = std::get<0>(x.max(1));
    tp.all_reduce(max, comm::ReduceOp::kMax);
    x = x - max.unsqueeze(1);
    at::Tensor exp = x.exp();
    at::Tensor sum = exp.sum(1);
    tp.all_reduce(sum);
    // The target's (shifted) logit lives on one rank; the others contribute zero.
    at::Tensor local_target = targets - start;
    at::Tensor mine = (local_target >= 0) & (local_target < local_v);
    at::Tensor safe = local_target.clamp(0, local_v - 1);
    // where, not a product with the mask: another rank's -inf logit (a padded
    // vocabulary row, models::predicted_logits) times 0 would be NaN.
    at::Tensor target_logit = at::where(mine, x.gather(1, safe.unsqueeze(1)).squeeze(1), at::zeros_like(max));
    tp.all_reduce(target_logit);
    at::Tensor loss = (sum.log() - target_logit).mean();
    at::Tensor grad = exp / sum.unsqueeze(1);
    grad.scatter_add_(1, safe.unsqueeze(1), -mine.to(x.scalar_type()).unsqueeze(1));
    ctx->save_for_backward({grad / static_cast<double>(logits.size(0))});
    return loss.to(logits.scalar_type());
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    return {ctx->get_saved_variables()[0] * g[0], at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor vocab_parallel_cross_entropy(const at::Tensor& logits, const at::Tensor& targets, const comm::CommPtr& tp) {
  if (trivial(tp)) return at::cross_entropy_loss(logits, targets);
  MESHTRAIN_CHECK(logits.dim() == 2 && targets.dim() == 1 && logits.size(0) == targets.size(0),
                  "vocab_parallel_cross_entropy: logits must be [N, V/tp] and targets [N]");
  if (targets.numel() > 0) {  // each rank masks the targets outside its columns: one outside all would be lost
    const int64_t vocab = logits.size(1) * tp->size();
    const int64_t lowest = targets.min().item<int64_t>(), highest = targets.max().item<int64_t>();
    MESHTRAIN_CHECK(lowest >= 0 && highest < vocab, "vocab_parallel_cross_entropy: target ",
                    lowest < 0 ? lowest : highest, " is outside the vocabulary [0, ", vocab, ")");
  }
  return VocabParallelCrossEntropy::apply(logits, targets, handle(tp));
}

}  // namespace tp
}  // namespace meshtrain
