#include "meshtrain/tp/parallelize.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>
#include <torch/nn/modules/linear.h>

#include <mutex>
#include <unordered_map>

#include "meshtrain/util/error.h"

namespace meshtrain {
namespace tp {

namespace {

// A key libtorch 1.13 registers nothing for, ordered after autograd: see
// docs/design/forward-interception.md.
constexpr c10::DispatchKey kSliced = c10::DispatchKey::Fake;

// TensorImpl keeps its key set protected; a member pointer formed through a
// derived class reaches it (the prototype's way; set_data copies key sets, so
// this runs after slicing).
struct KeySetAccess : c10::TensorImpl {
  static void add(const at::Tensor& t, c10::DispatchKey key) {
    c10::DispatchKeySet c10::TensorImpl::*keys = &KeySetAccess::key_set_;
    c10::TensorImpl* impl = t.unsafeGetTensorImpl();
    impl->*keys = (impl->*keys).add(key);
  }
};

// A sliced weight: its communicator and the dimension it was sliced along
// (by stride and size, which tell W from its transposed view W^T).
struct Slice {
  comm::CommPtr tp;
  int64_t stride = 0, size = 0;
  c10::Storage keep;  // the registry is keyed by StorageImpl*: never let an address be reused
};

std::mutex& registry_mutex() {
  static std::mutex m;
  return m;
}
std::unordered_map<const c10::StorageImpl*, Slice>& registry() {
  static std::unordered_map<const c10::StorageImpl*, Slice> r;
  return r;
}

const Slice* slice_of(const at::Tensor& t) {
  if (!t.defined() || !t.has_storage()) return nullptr;
  std::lock_guard<std::mutex> lock(registry_mutex());
  auto it = registry().find(t.storage().unsafeGetStorageImpl());
  return it == registry().end() ? nullptr : &it->second;
}

// Does `t` (an operand of a matrix product) contract over its sliced dimension?
bool contracts_slice(const at::Tensor& t, bool is_rhs, const Slice& s) {
  const int64_t d = is_rhs ? (t.dim() == 1 ? 0 : t.dim() - 2) : t.dim() - 1;
  return t.stride(d) == s.stride && t.size(d) == s.size;
}

void redispatch(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  op.redispatchBoxed(keys & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, kSliced), stack);
}

// Every operation on a sliced weight comes here. Matrix products that
// contract over the slice give partial sums: all-reduced over tp.
void on_sliced(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  c10::impl::ExcludeDispatchKeyGuard no_reentry(kSliced);  // our own ops below are not intercepted
  const std::string& name = op.schema().name();
  const size_t nargs = op.schema().arguments().size();
  const bool product = name == "aten::mm" || name == "aten::matmul" || name == "aten::addmm";
  if (!product) {
    const bool contraction = name == "aten::bmm" || name == "aten::baddbmm" || name == "aten::mv" ||
                             name == "aten::addmv" || name == "aten::dot" || name == "aten::addbmm";
    MESHTRAIN_CHECK(!contraction, "tp::parallelize: ", name, " on a sliced weight is not supported (only the matrix "
                    "products of torch::nn::Linear's forward and backward are); a partial sum would be silently wrong");
    return redispatch(op, keys, stack);
  }
  auto args = torch::jit::last(*stack, nargs);
  const int lhs = name == "aten::addmm" ? 1 : 0;  // addmm(bias, mat1, mat2, beta, alpha)
  const Slice* slice = nullptr;
  for (int i : {lhs, lhs + 1}) {
    const Slice* s = slice_of(args[i].toTensor());
    if (s && contracts_slice(args[i].toTensor(), i == lhs + 1, *s)) slice = s;
  }
  if (!slice) return redispatch(op, keys, stack);
  if (name == "aten::addmm") {  // the bias is added once, after the sum
    const at::Tensor bias = args[0].toTensor(), m1 = args[1].toTensor(), m2 = args[2].toTensor();
    const at::Scalar beta = args[3].toScalar(), alpha = args[4].toScalar();
    torch::jit::drop(*stack, nargs);
    at::Tensor out = at::mm(m1, m2);
    if (alpha.toDouble() != 1.0) out.mul_(alpha);
    slice->tp->all_reduce(out, comm::ReduceOp::kSum);
    out.add_(bias, beta);
    torch::jit::push(*stack, out);
    return;
  }
  redispatch(op, keys, stack);
  at::Tensor out = stack->back().toTensor();
  slice->tp->all_reduce(out, comm::ReduceOp::kSum);
}

void install_once() {
  static std::once_flag once;
  static std::unique_ptr<torch::Library> library;
  std::call_once(once, [] {
    MESHTRAIN_CHECK(!c10::Dispatcher::singleton().hasBackendFallbackForDispatchKey(kSliced),
                    "tp::parallelize: this libtorch already uses dispatch key Fake (meshtrain's tensor-parallel "
                    "marker); it was written against libtorch 1.13");
    library = std::make_unique<torch::Library>(torch::Library::IMPL, "_", kSliced, __FILE__, __LINE__);
    library->fallback(torch::CppFunction::makeFromBoxedFunction<&on_sliced>());
  });
}

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
  KeySetAccess::add(w, kSliced);
  std::lock_guard<std::mutex> lock(registry_mutex());
  registry()[w.storage().unsafeGetStorageImpl()] = Slice{tp, w.stride(dim), w.size(dim), w.storage()};
}

}  // namespace

void parallelize(torch::nn::Module& model, const comm::CommPtr& tp, const std::map<std::string, Style>& plan) {
  MESHTRAIN_CHECK(tp, "tp::parallelize needs a communicator");
  std::vector<std::pair<torch::nn::LinearImpl*, std::pair<std::string, Style>>> layers;
  for (const auto& kv : plan) layers.push_back({&linear_at(model, kv.first), kv});  // every path checked first
  if (tp->size() == 1) return;
  install_once();
  for (auto& l : layers) slice_linear(*l.first, l.second.first, l.second.second, tp);
}

}  // namespace tp
}  // namespace meshtrain
