#include "tp/cut.h"

#include <ATen/ATen.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/library.h>

#include <mutex>
#include <set>

#include "meshtrain/tp.h"
#include "meshtrain/util.h"

namespace meshtrain {
namespace tp {

namespace {

constexpr c10::DispatchKey kAboveAutograd = intercept::kAboveAutogradMarker;

// Depth of this thread's kernels below: their own products pass the guard.
thread_local int kernel_depth = 0;

// Inside a kernel: its operations go to autograd (the key excluded) and pass the guard.
class InKernel {
 public:
  InKernel() { ++kernel_depth; }
  ~InKernel() { --kernel_depth; }
  InKernel(const InKernel&) = delete;
  InKernel& operator=(const InKernel&) = delete;

 private:
  c10::impl::ExcludeDispatchKeyGuard above_{kAboveAutograd};
};

bool is_contraction(const std::string& name) {
  static const std::set<std::string> contractions = {"aten::mm", "aten::matmul", "aten::addmm", "aten::bmm",
      "aten::baddbmm", "aten::mv", "aten::addmv", "aten::dot", "aten::vdot", "aten::addbmm", "aten::linear",
      "aten::_trilinear"};
  return contractions.count(name) > 0;
}

}  // namespace

Cut::Cut(comm::CommPtr tp, Style style, bool sequence_parallel, const at::Tensor& weight)
    : tp(std::move(tp)), style(style), sequence_parallel(sequence_parallel), dim(style == Style::kRowwise ? 1 : 0),
      stride(weight.stride(dim)), size(weight.size(dim)) {}

bool Cut::run(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  (void)keys, (void)stack;
  // The kernels' own products and backward's (inside a graph task: the
  // gradients of what the kernels recorded) are right by construction.
  if (kernel_depth > 0 || torch::autograd::get_current_graph_task_nodes_in_graph() != nullptr) return false;
  MESHTRAIN_CHECK(!is_contraction(op.schema().name()), "tp::parallelize: ", op.schema().name(), " on a cut weight "
                  "is not supported (only x W^T, as torch::nn::Linear's forward, at::linear and at::matmul compute "
                  "it, are); a partial sum would be silently wrong");
  return false;
}

const Cut* cut_of(const at::Tensor& t) { return intercept::role_of<const Cut>(t); }
const VocabRows* vocab_rows_of(const at::Tensor& t) { return intercept::role_of<const VocabRows>(t); }
const SequenceRows* sequence_rows_of(const at::Tensor& t) { return intercept::role_of<const SequenceRows>(t); }

namespace {

// ---- kColwise's input, shared by the layers that read it
//
// q, k and v read one input: one copy_to_tp (one all-reduce of its gradient
// in backward) or one all-gather of the sequence serves all three, as
// Megatron's fused QKV layer. The last prepared input is remembered until a
// kRowwise product ends the region (or the next input replaces it): a hit
// needs the same live input (a weak reference) at the same version, in the
// same grad mode, requiring grad as before, for the same communicator and
// kind. The prepared tensor itself is held: copy_to_tp returns a view of its
// input, which the first layer's saved tensors do not keep alive (their base
// is the input). Ranks run the same layers on the same inputs, so they hit
// alike (under sequence parallelism a miss is a collective).
using Weak = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;
struct LastPrepared {
  Weak input{c10::intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>()};
  at::Tensor output;
  uint32_t version = 0;
  const comm::Communicator* tp = nullptr;
  bool sequence_parallel = false, grad = false, requires_grad = false;
};
thread_local LastPrepared last_prepared;

void forget_prepared() { last_prepared = LastPrepared(); }

at::Tensor prepare(const at::Tensor& x, const Cut& cut) {
  // Inference tensors have no version counter: no sharing (InferenceMode records no gradients to sum anyway).
  if (x.is_inference()) return cut.sequence_parallel ? gather_from_sp(x, cut.tp) : copy_to_tp(x, cut.tp);
  LastPrepared& last = last_prepared;
  const bool grad = at::GradMode::is_enabled();
  if (last.output.defined() && last.tp == cut.tp.get() && last.sequence_parallel == cut.sequence_parallel &&
      last.grad == grad && last.requires_grad == x.requires_grad() &&
      last.input._unsafe_get_target() == x.unsafeGetTensorImpl() && !last.input.expired() &&
      last.version == x._version()) {
    return last.output;
  }
  at::Tensor out = cut.sequence_parallel ? gather_from_sp(x, cut.tp) : copy_to_tp(x, cut.tp);
  last.input = Weak(x.getIntrusivePtr());
  last.output = out;
  last.version = x._version();
  last.tp = cut.tp.get();
  last.sequence_parallel = cut.sequence_parallel;
  last.grad = grad;
  last.requires_grad = x.requires_grad();
  return out;
}

// kRowwise's partial products: summed, or reduce-scattered over the sequence.
at::Tensor reduce(const at::Tensor& partial, const Cut& cut) {
  forget_prepared();  // the region's end: nothing held past it
  return cut.sequence_parallel ? reduce_scatter_to_sp(partial, cut.tp) : reduce_from_tp(partial, cut.tp);
}

void check_sequence(const at::Tensor& x, const Cut& cut, const char* op) {
  MESHTRAIN_CHECK(!cut.sequence_parallel || x.dim() == 3, "tp::parallelize with sequence_parallel: ", op, " got a ",
                  x.dim(), "-d input; sequence parallelism cuts dimension 1 of [batch, seq, features] (call the layer, "
                  "or at::matmul, on the 3-d activations; at::linear flattens them into addmm)");
}

// The cut of `rhs` when it is W^T for a cut weight W (the orientation of x W^T); refuses other uses.
const Cut* cut_of_transposed(const at::Tensor& lhs, const at::Tensor& rhs, const char* op) {
  MESHTRAIN_CHECK(!cut_of(lhs) && !vocab_rows_of(lhs), "tp::parallelize: ", op, " with a cut weight as its left "
                  "operand is not supported (only x W^T, as torch::nn::Linear computes it)");
  const Cut* cut = cut_of(rhs);
  if (!cut) {
    MESHTRAIN_CHECK(!vocab_rows_of(rhs), "tp::parallelize: ", op, " with the rows of a vocabulary-parallel Embedding "
                    "that tp does not divide evenly: a head multiplying by it would cut the logits unevenly; register "
                    "the head's weight as the embedding's (a tied head) and pad the vocabulary to a multiple of tp");
    return nullptr;
  }
  const int64_t d = cut->dim == 0 ? rhs.dim() - 1 : rhs.dim() - 2;  // where W^T keeps the cut dimension
  MESHTRAIN_CHECK(rhs.dim() == 2 && rhs.stride(d) == cut->stride && rhs.size(d) == cut->size, "tp::parallelize: ",
                  op, " with a cut weight other than as W^T (x W^T, as torch::nn::Linear computes it) is not "
                  "supported; a partial sum would be silently wrong");
  return cut;
}

at::Tensor parallel_matmul(const at::Tensor& x, const at::Tensor& rhs) {
  InKernel in;
  const Cut* cut = cut_of_transposed(x, rhs, "matmul");
  if (!cut) return at::matmul(x, rhs);
  check_sequence(x, *cut, "matmul");
  if (cut->style == Style::kColwise) return at::matmul(prepare(x, *cut), rhs);
  return reduce(at::matmul(x, rhs), *cut);
}

at::Tensor parallel_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  InKernel in;
  const Cut* cut = cut_of_transposed(x, weight.t(), "linear");
  if (!cut) return at::linear(x, weight, bias);
  check_sequence(x, *cut, "linear");
  if (cut->style == Style::kColwise) return at::linear(prepare(x, *cut), weight, bias);
  at::Tensor y = reduce(at::linear(x, weight), *cut);
  return bias && bias->defined() ? y + *bias : y;  // under sequence parallelism its gradient is summed (hook)
}

at::Tensor parallel_addmm(const at::Tensor& bias, const at::Tensor& m1, const at::Tensor& m2, const at::Scalar& beta,
                          const at::Scalar& alpha) {
  InKernel in;
  const Cut* cut = cut_of_transposed(m1, m2, "addmm");
  if (!cut) return at::addmm(bias, m1, m2, beta, alpha);
  check_sequence(m1, *cut, "addmm");
  if (cut->style == Style::kColwise) return at::addmm(bias, prepare(m1, *cut), m2, beta, alpha);
  at::Tensor y = at::mm(m1, m2);
  if (alpha.toDouble() != 1.0) y = y * alpha;
  y = reduce(y, *cut);
  return beta.toDouble() == 0.0 ? y : at::add(y, bias, beta);  // the bias once, after the sum (beta 0: ignored, as addmm)
}

// Megatron's VocabParallelEmbedding: look up the indices in this rank's rows,
// zeros for the others, summed over tp (the sum's backward is the identity).
// aten::embedding's backward sees only the indices and the number of rows, so
// the shift into this rank's rows must happen before autograd records it.
at::Tensor parallel_embedding(const at::Tensor& weight, const at::Tensor& indices, int64_t padding_idx,
                              bool scale_grad_by_freq, bool sparse) {
  InKernel in;
  if (const SequenceRows* s = sequence_rows_of(weight)) {
    const at::Tensor rows = at::embedding(weight, indices, padding_idx, scale_grad_by_freq, sparse);
    MESHTRAIN_CHECK(rows.dim() == 3, "tp::parallelize with sequence_parallel: the table planned kSequenceParallel "
                    "was read with ", indices.dim(), "-d indices; sequence parallelism cuts dimension 1 of [batch, "
                    "seq] (read a position table with positions.unsqueeze(0))");
    return scatter_to_sp(rows, s->tp);
  }
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
  if (!v->sequence_parallel) return reduce_from_tp(partial, v->tp);
  MESHTRAIN_CHECK(partial.dim() == 3, "tp::parallelize with sequence_parallel: the Embedding got ", indices.dim(),
                  "-d indices; sequence parallelism cuts dimension 1 of [batch, seq]");
  return reduce_scatter_to_sp(partial, v->tp);
}

void install_kernels_once() {
  static std::once_flag once;
  static std::unique_ptr<torch::Library> kernels, fallthrough;
  std::call_once(once, [] {
    MESHTRAIN_CHECK(!c10::Dispatcher::singleton().hasBackendFallbackForDispatchKey(kAboveAutograd),
                    "tp::parallelize: this libtorch already uses dispatch key DeferredInit (meshtrain's tensor-parallel "
                    "kernels); meshtrain was written against libtorch 1.13");
    fallthrough = std::make_unique<torch::Library>(torch::Library::IMPL, "_", kAboveAutograd, __FILE__, __LINE__);
    fallthrough->fallback(torch::CppFunction::makeFallthrough());
    kernels = std::make_unique<torch::Library>(torch::Library::IMPL, "aten", kAboveAutograd, __FILE__, __LINE__);
    kernels->impl("embedding", TORCH_FN(parallel_embedding));
    kernels->impl("linear", TORCH_FN(parallel_linear));
    kernels->impl("matmul", TORCH_FN(parallel_matmul));
    kernels->impl("addmm", TORCH_FN(parallel_addmm));
  });
}

}  // namespace

void add_kernel_key(const at::Tensor& weight) {
  install_kernels_once();
  intercept::add_dispatch_key(weight, kAboveAutograd);
}

void mark_sequence_rows(const at::Tensor& table, const comm::CommPtr& tp) {
  intercept::mark(table, std::make_shared<SequenceRows>(tp));
  add_kernel_key(table);
}

namespace {
class SummedOverTp : public intercept::Role {};  // marks a parameter sum_gradient_over_tp hooked
}  // namespace

bool summed_over_tp(const at::Tensor& param) { return intercept::role_of<const SummedOverTp>(param) != nullptr; }

void sum_gradient_over_tp(at::Tensor& param, const comm::CommPtr& tp) {
  intercept::mark(param, std::make_shared<SummedOverTp>());
  param.register_hook([tp](const at::Tensor& grad) {
    at::Tensor sum = grad.clone();
    tp->all_reduce(sum, comm::ReduceOp::kSum);
    return sum;
  });
}

}  // namespace tp
}  // namespace meshtrain
