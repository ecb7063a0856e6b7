#include "util/intercept.h"

#include <torch/library.h>

#include <algorithm>
#include <mutex>
#include <unordered_map>

#include "meshtrain/util.h"

namespace meshtrain {
namespace intercept {

namespace {

// TensorImpl keeps its key set protected; a member pointer formed through a
// derived class reaches it.
struct KeySetAccess : c10::TensorImpl {
  static void add(const at::Tensor& t, c10::DispatchKey key) {
    c10::DispatchKeySet c10::TensorImpl::*keys = &KeySetAccess::key_set_;
    c10::TensorImpl* impl = t.unsafeGetTensorImpl();
    impl->*keys = (impl->*keys).add(key);
  }
};

// The elements [begin, end) of its storage a tensor can reach.
struct Span {
  int64_t begin = 0, end = 0;
  bool overlaps(const Span& o) const { return begin < o.end && o.begin < end; }
};
Span span_of(const at::Tensor& t) {
  int64_t last = t.storage_offset();
  for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
  return {t.storage_offset(), t.numel() == 0 ? t.storage_offset() : last + 1};
}

// A storage may hold several marked tensors (ZeRO-1/2 lay parameters end to
// end in one flat buffer): each role applies to the span it was marked on.
struct Marks {
  c10::Storage keep;  // the registry is keyed by StorageImpl*: never let an address be reused
  struct Entry {
    Mark mark;
    Span span;
  };
  std::vector<Entry> entries;
};

std::mutex& registry_mutex() {
  static std::mutex m;
  return m;
}
std::unordered_map<const c10::StorageImpl*, Marks>& registry() {
  static std::unordered_map<const c10::StorageImpl*, Marks> r;
  return r;
}

// One operand's roles, or none.
void collect(const at::Tensor& t, size_t arg, const c10::FunctionSchema& schema, std::vector<Role*>& touched,
             std::vector<std::pair<Role*, int>>& written) {
  const bool writes = schema.arguments()[arg].alias_info() && schema.arguments()[arg].alias_info()->isWrite();
  for (const auto& r : roles_of(t)) {
    if (std::find(touched.begin(), touched.end(), r.first) == touched.end()) touched.push_back(r.first);
    if (writes) written.push_back(r);
  }
}

void on_marked(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  Bypass no_reentry;  // the roles' own ops are not intercepted
  const c10::FunctionSchema& schema = op.schema();
  const size_t nargs = schema.arguments().size();
  std::vector<Role*> touched;
  std::vector<std::pair<Role*, int>> written;
  auto args = torch::jit::last(*stack, nargs);
  for (size_t i = 0; i < nargs; ++i) {
    if (args[i].isTensor()) {
      collect(args[i].toTensor(), i, schema, touched, written);
    } else if (args[i].isTensorList() || args[i].isOptionalTensorList()) {
      for (const c10::IValue& e : args[i].toListRef())
        if (e.isTensor()) collect(e.toTensor(), i, schema, touched, written);
    }
  }
  for (Role* r : touched) r->before(touched);
  bool ran = false;
  for (Role* r : touched) {
    if ((ran = r->run(op, keys, stack))) break;
  }
  if (!ran) redispatch(op, keys, stack);
  for (const auto& w : written) w.first->written(w.second);
}

void install_once() {
  static std::once_flag once;
  static std::unique_ptr<torch::Library> library;
  std::call_once(once, [] {
    MESHTRAIN_CHECK(!c10::Dispatcher::singleton().hasBackendFallbackForDispatchKey(kMarker),
                    "meshtrain: this libtorch already uses dispatch key Fake (meshtrain's marker for tensor-parallel "
                    "and fully sharded parameters); meshtrain was written against libtorch 1.13");
    library = std::make_unique<torch::Library>(torch::Library::IMPL, "_", kMarker, __FILE__, __LINE__);
    library->fallback(torch::CppFunction::makeFromBoxedFunction<&on_marked>());
  });
}

}  // namespace

void mark(const at::Tensor& t, std::shared_ptr<Role> role, int index) {
  MESHTRAIN_CHECK(t.defined() && t.has_storage(), "intercept::mark needs a tensor with storage");
  install_once();
  add_dispatch_key(t, kMarker);
  std::lock_guard<std::mutex> lock(registry_mutex());
  Marks& m = registry()[t.storage().unsafeGetStorageImpl()];
  m.keep = t.storage();
  m.entries.push_back({Mark{std::move(role), index}, span_of(t)});
}

void forget_all() {
  std::unordered_map<const c10::StorageImpl*, Marks> dropped;
  {
    std::lock_guard<std::mutex> lock(registry_mutex());
    dropped.swap(registry());
  }  // the roles' destructors run here, outside the lock (they may free tensors)
}

void set_data_keeping_marks(const at::Tensor& t, const at::Tensor& data) {
  std::vector<Mark> moved;
  if (t.has_storage()) {
    std::lock_guard<std::mutex> lock(registry_mutex());
    auto it = registry().find(t.storage().unsafeGetStorageImpl());
    if (it != registry().end()) {
      const Span mine = span_of(t);
      auto& entries = it->second.entries;
      for (const auto& e : entries)
        if (e.span.overlaps(mine)) moved.push_back(e.mark);
      entries.erase(std::remove_if(entries.begin(), entries.end(), [&](const Marks::Entry& e) { return e.span.overlaps(mine); }),
                    entries.end());
      if (entries.empty()) registry().erase(it);  // the old storage is free to go
    }
  }
  const bool above = t.key_set().has(kAboveAutogradMarker);
  t.set_data(data);
  for (const Mark& m : moved) mark(t, m.role, m.index);
  if (above) add_dispatch_key(t, kAboveAutogradMarker);
}

std::vector<Mark> marks_of(const at::Tensor& t) {
  std::vector<Mark> out;
  if (!t.defined() || !t.has_storage()) return out;
  std::lock_guard<std::mutex> lock(registry_mutex());
  auto it = registry().find(t.storage().unsafeGetStorageImpl());
  if (it == registry().end()) return out;
  const Span mine = span_of(t);
  for (const auto& e : it->second.entries)
    if (e.span.overlaps(mine)) out.push_back(e.mark);
  return out;
}

void add_dispatch_key(const at::Tensor& t, c10::DispatchKey key) { KeySetAccess::add(t, key); }

std::vector<std::pair<Role*, int>> roles_of(const at::Tensor& t) {
  std::vector<std::pair<Role*, int>> out;
  for (const Mark& m : marks_of(t)) out.emplace_back(m.role.get(), m.index);
  return out;
}

void redispatch(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  op.redispatchBoxed(keys & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, kMarker), stack);
}

}  // namespace intercept
}  // namespace meshtrain
