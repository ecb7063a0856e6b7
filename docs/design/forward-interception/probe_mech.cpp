// probe_mech.cpp -- which libtorch 1.13 mechanisms can intercept ops on specific tensors from C++?
//   M1  : m.fallback() on DispatchKey::Python                   (expected: already taken by libtorch_cpu)
//   M1b : DispatchKey::Python + set_python_dispatch(true) + a C++ PyInterpreterVTable (no Python at all)
//   M2  : free functionality key (Fake = post-autograd, DeferredInit = pre-autograd) added to the
//         param's TensorImpl key set, with our own boxed fallback
//   M2s : same key added through Tensor::set_data() instead of the protected-member trick
//   M2t : TLS "mode" (IncludeDispatchKeyGuard) -- TorchDispatchMode analogue, intercepts everything
// Build: see build.sh
#include <torch/torch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/PythonFallbackKernel.h>
#include <c10/core/impl/PyInterpreter.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <chrono>
#include <iostream>
#include <sstream>

using K = c10::DispatchKey;
namespace F = torch::nn::functional;

// ---------------------------------------------------------------- logging
static thread_local bool g_log = false;
static thread_local std::vector<std::string> g_ops;
static long g_count = 0;

static std::string describe(const c10::OperatorHandle& op, torch::jit::Stack* s, c10::DispatchKey mark) {
  std::ostringstream o;
  o << op.schema().name();
  if (!op.schema().overload_name().empty()) o << "." << op.schema().overload_name();
  o << "(";
  auto n = op.schema().arguments().size();
  bool first = true;
  for (const auto& iv : torch::jit::last(*s, n)) {
    if (!iv.isTensor()) continue;
    const auto& t = iv.toTensor();
    if (!first) o << ",";
    first = false;
    if (!t.defined()) { o << "undef"; continue; }
    o << (t.key_set().has(mark) ? "P" : "") << t.sizes();
  }
  o << ")";
  return o.str();
}

// ---------------------------------------------------------------- M2: our own key
struct KeyHack : c10::TensorImpl {  // legal access to the protected key_set_ via a derived-class member pointer
  static void add(const at::Tensor& t, c10::DispatchKey k) {
    c10::DispatchKeySet c10::TensorImpl::*p = &KeyHack::key_set_;
    auto* impl = t.unsafeGetTensorImpl();
    impl->*p = (impl->*p).add(k);
  }
};

template <K KEY>
void passthrough(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  ++g_count;
  if (g_log) g_ops.push_back(describe(op, stack, KEY));
  c10::impl::ExcludeDispatchKeyGuard g(KEY);  // nested calls of composite kernels are not re-intercepted
  op.redispatchBoxed(ks & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, KEY), stack);
}

// ---------------------------------------------------------------- M2t: TLS mode
void modeFallback(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  ++g_count;
  if (g_log) g_ops.push_back(describe(op, stack, K::TESTING_ONLY_GenericMode));
  c10::impl::ExcludeDispatchKeyGuard g(K::TESTING_ONLY_GenericMode);
  op.redispatchBoxed(ks & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, K::TESTING_ONLY_GenericMode), stack);
}

// ---------------------------------------------------------------- M1b: C++ "PyInterpreter"
static int g_dummy_pyobj;
struct CppInterp final : c10::impl::PyInterpreterVTable {
  std::string name() const override { return "meshtrain-cpp-interp"; }
  void decref(PyObject*, bool) const override {}
  c10::intrusive_ptr<c10::TensorImpl> detach(const c10::TensorImpl*) const override;
  void dispatch(const c10::OperatorHandle& op, torch::jit::Stack* stack) const override;
  void python_dispatcher(const c10::OperatorHandle&, c10::DispatchKeySet, torch::jit::Stack*) const override { TORCH_CHECK(false, "python_dispatcher"); }
  bool is_contiguous(const c10::TensorImpl*, at::MemoryFormat) const override { TORCH_CHECK(false, "is_contiguous"); }
  bool is_strides_like(const c10::TensorImpl*, at::MemoryFormat) const override { TORCH_CHECK(false, "is_strides_like"); }
  bool is_non_overlapping_and_dense(const c10::TensorImpl*) const override { TORCH_CHECK(false, "nonoverlap"); }
  c10::Device device(const c10::TensorImpl*) const override { TORCH_CHECK(false, "device"); }
  int64_t dim(const c10::TensorImpl*) const override { TORCH_CHECK(false, "dim"); }
  c10::IntArrayRef strides(const c10::TensorImpl*) const override { TORCH_CHECK(false, "strides"); }
  c10::IntArrayRef sizes(const c10::TensorImpl*) const override { TORCH_CHECK(false, "sizes"); }
  c10::SymIntArrayRef sym_sizes(const c10::TensorImpl*) const override { TORCH_CHECK(false, "sym_sizes"); }
  c10::Layout layout(const c10::TensorImpl*) const override { TORCH_CHECK(false, "layout"); }
  c10::SymInt sym_numel(const c10::TensorImpl*) const override { TORCH_CHECK(false, "numel"); }
  c10::SymIntArrayRef sym_strides(const c10::TensorImpl*) const override { TORCH_CHECK(false, "sym_strides"); }
  c10::SymInt sym_storage_offset(const c10::TensorImpl*) const override { TORCH_CHECK(false, "offset"); }
  void trace_gpu_event_creation(uintptr_t) const override {}
  void trace_gpu_event_deletion(uintptr_t) const override {}
  void trace_gpu_event_record(uintptr_t, uintptr_t) const override {}
  void trace_gpu_event_wait(uintptr_t, uintptr_t) const override {}
  void trace_gpu_memory_allocation(uintptr_t) const override {}
  void trace_gpu_memory_deallocation(uintptr_t) const override {}
  void trace_gpu_stream_creation(uintptr_t) const override {}
  void trace_gpu_device_synchronization() const override {}
  void trace_gpu_stream_synchronization(uintptr_t) const override {}
  void trace_gpu_event_synchronization(uintptr_t) const override {}
};
static CppInterp g_vtable;
static c10::impl::PyInterpreter g_interp(&g_vtable);
static bool g_remark_views = true;
static long g_detach_calls = 0;

static void mark_python(const at::Tensor& t) {
  auto* impl = t.unsafeGetTensorImpl();
  impl->set_python_dispatch(true);
  if (!impl->pyobj_interpreter())
    impl->init_pyobj(&g_interp, reinterpret_cast<PyObject*>(&g_dummy_pyobj),
                     c10::impl::PyInterpreterStatus::DEFINITELY_UNINITIALIZED);
}
c10::intrusive_ptr<c10::TensorImpl> CppInterp::detach(const c10::TensorImpl* self) const {
  ++g_detach_calls;
  // Plain shallow copy with the Python key excluded (so we do not recurse), then re-mark.
  c10::impl::ExcludeDispatchKeyGuard g(c10::python_ks);
  auto r = self->shallow_copy_and_detach(self->version_counter(), self->allow_tensor_metadata_change());
  r->set_python_dispatch(true);
  r->init_pyobj(&g_interp, reinterpret_cast<PyObject*>(&g_dummy_pyobj), c10::impl::PyInterpreterStatus::DEFINITELY_UNINITIALIZED);
  return r;
}
void CppInterp::dispatch(const c10::OperatorHandle& op, torch::jit::Stack* stack) const {
  ++g_count;
  if (g_log) g_ops.push_back(describe(op, stack, K::Python));
  // collect storages of marked inputs so that view outputs can be re-marked
  std::vector<const c10::StorageImpl*> marked;
  for (const auto& iv : torch::jit::last(*stack, op.schema().arguments().size()))
    if (iv.isTensor() && iv.toTensor().defined() && iv.toTensor().unsafeGetTensorImpl()->is_python_dispatch() &&
        iv.toTensor().has_storage())
      marked.push_back(iv.toTensor().storage().unsafeGetStorageImpl());
  {
    at::impl::RestorePythonTLSSnapshot snap;  // TLS as it was on dispatcher entry (pythonFallback excluded all keys below Python)
    c10::impl::ExcludeDispatchKeyGuard g(c10::python_ks | c10::autograd_dispatch_keyset_with_ADInplaceOrView);
    op.callBoxed(stack);
  }
  if (!g_remark_views) return;
  for (auto& iv : torch::jit::last(*stack, op.schema().returns().size()))
    if (iv.isTensor() && iv.toTensor().defined() && iv.toTensor().has_storage())
      for (auto* s : marked)
        if (iv.toTensor().storage().unsafeGetStorageImpl() == s) mark_python(iv.toTensor());
}

// ---------------------------------------------------------------- tests
static void dump(const char* title) {
  std::cout << "    " << title << ": ";
  for (auto& s : g_ops) std::cout << s << "  ";
  std::cout << "\n";
  g_ops.clear();
}

using MarkFn = std::function<void(const at::Tensor&)>;

static double maxdiff(const at::Tensor& a, const at::Tensor& b) {
  return (a - b).abs().max().item<double>();
}

static void suite(const std::string& name, MarkFn mark, c10::DispatchKey key) {
  std::cout << "=== " << name << "\n";
  torch::manual_seed(0);
  torch::nn::Linear ref(8, 32), lin(8, 32);
  ref->to(torch::kDouble);
  lin->to(torch::kDouble);
  {
    torch::NoGradGuard ng;
    lin->weight.copy_(ref->weight);
    lin->bias.copy_(ref->bias);
  }
  try {
    mark(lin->weight);
    mark(lin->bias);
  } catch (const std::exception& e) {
    std::cout << "  mark failed: " << e.what() << "\n";
    return;
  }
  std::cout << "  weight has key: " << lin->weight.key_set().has(key)
            << " | t() has key: " << lin->weight.t().key_set().has(key)
            << " | detach() has key: " << lin->weight.detach().key_set().has(key)
            << " | .data() has key: " << lin->weight.data().key_set().has(key) << "\n";
  for (int dim : {2, 3}) {
    auto x0 = dim == 2 ? torch::randn({4, 8}, torch::kDouble) : torch::randn({2, 3, 8}, torch::kDouble);
    auto xr = x0.clone().requires_grad_(true), xl = x0.clone().requires_grad_(true);
    ref->zero_grad();
    lin->zero_grad();
    ref(xr).pow(2).sum().backward();
    g_log = true;
    auto y = lin(xl);
    dump(dim == 2 ? "2-D fwd" : "3-D fwd");
    y.pow(2).sum().backward();
    dump(dim == 2 ? "2-D bwd" : "3-D bwd");
    g_log = false;
    std::cout << "    max|dW|=" << maxdiff(ref->weight.grad(), lin->weight.grad())
              << " max|db|=" << maxdiff(ref->bias.grad(), lin->bias.grad())
              << " max|dx|=" << maxdiff(xr.grad(), xl.grad()) << "\n";
  }
  auto x3 = torch::randn({2, 3, 8}, torch::kDouble);
  {
    torch::NoGradGuard ng;
    g_log = true;
    auto y = lin(x3);
    dump("no_grad 3-D fwd");
    auto y2 = lin(x3.select(0, 0));
    dump("no_grad 2-D fwd");
    g_log = false;
  }
  {
    c10::InferenceMode im;
    g_log = true;
    auto y = lin(x3);
    dump("InferenceMode 3-D fwd");
    g_log = false;
  }
  {
    torch::NoGradGuard ng;
    g_log = true;
    lin->weight.mul_(1.0);
    dump("in-place weight.mul_(1)");
    lin->weight.data().add_(0.0);
    dump("weight.data().add_(0)");
    std::ostringstream sink;
    sink << lin->bias;
    dump("operator<<(bias)");
    g_log = false;
  }
}

static double time_loop(torch::nn::Linear& lin, const at::Tensor& x, int n, bool grad) {
  torch::AutoGradMode gm(grad);
  auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < n; ++i) {
    auto y = lin(x);
  }
  auto t1 = std::chrono::steady_clock::now();
  return std::chrono::duration<double, std::micro>(t1 - t0).count() / n;
}

static void timing(const std::string& name, MarkFn mark) {
  torch::manual_seed(0);
  torch::nn::Linear lin(8, 32);
  auto x2 = torch::randn({4, 8}), x3 = torch::randn({2, 3, 8});
  for (int i = 0; i < 500; ++i) lin(x2);  // warmup
  double p2 = time_loop(lin, x2, 10000, true), p3 = time_loop(lin, x3, 10000, true),
         n2 = time_loop(lin, x2, 10000, false);
  if (mark) {
    mark(lin->weight);
    mark(lin->bias);
  }
  long c0 = g_count;
  double m2 = time_loop(lin, x2, 10000, true), m3 = time_loop(lin, x3, 10000, true),
         mn2 = time_loop(lin, x2, 10000, false);
  std::cout << "  timing " << name << ": us/call grad 2-D " << p2 << " -> " << m2 << " | grad 3-D " << p3 << " -> " << m3
            << " | no_grad 2-D " << n2 << " -> " << mn2 << " | intercepted ops/call "
            << double(g_count - c0) / 30000 << "\n";
}

int main(int argc, char** argv) {
  torch::set_num_threads(1);
  std::string sel = argc > 1 ? argv[1] : "py,key,mode,time";
  auto want = [&](const char* w) { return sel.find(w) != std::string::npos; };
  std::vector<std::unique_ptr<torch::Library>> libs;

  // ---- M1: try to take over the Python key fallback
  try {
    auto l = std::make_unique<torch::Library>(torch::Library::IMPL, "_", K::Python, __FILE__, __LINE__);
    l->fallback(torch::CppFunction::makeFromBoxedFunction<&passthrough<K::Python>>());
    std::cout << "M1 Python fallback registration: SUCCEEDED (unexpected)\n";
    libs.push_back(std::move(l));
  } catch (const std::exception& e) {
    std::string s = e.what();
    std::cout << "M1 Python fallback registration FAILED: " << s.substr(0, s.find('\n', 200)) << "\n";
  }

  // ---- register our keys
  for (K k : {K::Fake, K::DeferredInit}) {
    auto l = std::make_unique<torch::Library>(torch::Library::IMPL, "_", k, __FILE__, __LINE__);
    if (k == K::Fake) l->fallback(torch::CppFunction::makeFromBoxedFunction<&passthrough<K::Fake>>());
    else l->fallback(torch::CppFunction::makeFromBoxedFunction<&passthrough<K::DeferredInit>>());
    libs.push_back(std::move(l));
  }
  {
    auto l = std::make_unique<torch::Library>(torch::Library::IMPL, "_", K::TESTING_ONLY_GenericMode, __FILE__, __LINE__);
    l->fallback(torch::CppFunction::makeFromBoxedFunction<&modeFallback>());
    libs.push_back(std::move(l));
  }

  if (want("py")) {
  suite("M1b Python key + C++ PyInterpreterVTable (views re-marked)", mark_python, K::Python);
  g_remark_views = false;
  suite("M1b' Python key + C++ PyInterpreterVTable (views NOT re-marked)", mark_python, K::Python);
  g_remark_views = true;
  std::cout << "  (CppInterp::detach called " << g_detach_calls << " times)\n";
  }
  if (want("key")) {
  suite("M2 Fake key (post-autograd) via KeyHack", [](const at::Tensor& t) { KeyHack::add(t, K::Fake); }, K::Fake);
  suite("M2 DeferredInit key (pre-autograd) via KeyHack", [](const at::Tensor& t) { KeyHack::add(t, K::DeferredInit); },
        K::DeferredInit);
  suite("M2s Fake key via Tensor::set_data()",
        [](const at::Tensor& t) {
          // build a TensorImpl sharing t's storage whose key set includes Fake, then set_data it into t
          auto impl = c10::make_intrusive<c10::TensorImpl>(c10::Storage(t.storage()), t.key_set().add(K::Fake), t.dtype());
          impl->set_sizes_and_strides(t.sizes(), t.strides());
          at::Tensor carrier(std::move(impl));
          const_cast<at::Tensor&>(t).set_data(carrier);
        },
        K::Fake);
  }

  // ---- M2t: TLS mode: every op in scope is intercepted
  if (want("mode")) {
    std::cout << "=== M2t TLS include-mode (TESTING_ONLY_GenericMode)\n";
    torch::nn::Linear lin(8, 32);
    auto x = torch::randn({4, 8}, torch::requires_grad());
    g_log = true;
    {
      c10::impl::IncludeDispatchKeyGuard inc(K::TESTING_ONLY_GenericMode);
      auto y = lin(x);
      dump("2-D fwd under mode");
      y.sum().backward();
      dump("2-D bwd (backward() called inside mode scope)");
    }
    g_log = false;
  }

  if (!want("time")) return 0;
  std::cout << "=== timing (float32, Linear(8,32), 10k calls, forward only)\n";
  timing("plain (no mark)", nullptr);
  timing("M2 Fake key passthrough", [](const at::Tensor& t) { KeyHack::add(t, K::Fake); });
  timing("M2 DeferredInit key passthrough", [](const at::Tensor& t) { KeyHack::add(t, K::DeferredInit); });
  if (want("py")) timing("M1b Python key + CppInterp", mark_python);
  {
    torch::nn::Linear lin(8, 32);
    auto x2 = torch::randn({4, 8});
    double p = time_loop(lin, x2, 10000, true);
    c10::impl::IncludeDispatchKeyGuard inc(K::TESTING_ONLY_GenericMode);
    long c0 = g_count;
    double m = time_loop(lin, x2, 10000, true);
    std::cout << "  timing M2t TLS mode (all ops): grad 2-D " << p << " -> " << m << " us/call, intercepted ops/call "
              << double(g_count - c0) / 10000 << "\n";
  }
  return 0;
}
