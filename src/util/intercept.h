#pragma once
// Intercepting every operation on chosen parameter tensors, after autograd,
// without touching the module's forward (internal; shared by tp::parallelize
// and zero::fully_shard). See docs/design/forward-interception.md.
//
// A marked tensor carries a dispatch key that libtorch 1.13 registers nothing
// for (DispatchKey::Fake, ordered after autograd); views, detach() and .data()
// keep it. One boxed fallback on that key sees each operation whose operands
// include a marked tensor, looks their storages up in a registry, and lets
// the roles attached there act: gather a ZeRO unit before the op, refuse a
// contraction of a tp-cut weight, copy an in-place write back to a shard.
// Operations a role runs itself are not intercepted again.

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <memory>
#include <vector>

namespace meshtrain {
namespace intercept {

class Role {
 public:
  virtual ~Role() = default;
  // Before an operation that reads or writes a tensor of this role; `touched`
  // holds every role the operation's operands carry (each once).
  virtual void before(const std::vector<Role*>& touched) { (void)touched; }
  // May run the operation itself (leaving its outputs on the stack); false
  // leaves it to the next kernel.
  virtual bool run(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
    (void)op, (void)keys, (void)stack;
    return false;
  }
  // After the operation wrote in place the tensor marked with `index`.
  virtual void written(int index) { (void)index; }
};

// Attaches `role` to the part of t's storage t spans (every view into it)
// under `index`. A tensor may carry several roles (a tp slice inside a ZeRO
// unit), a storage several tensors' (ZeRO-1/2's flat buffer). Call after any
// Module::to() or set_data() on t, which would drop the key (marks_of before
// and mark after carry them over). The registry keeps the storage and role
// alive for the process (Note [Roles live until exit]).
void mark(const at::Tensor& t, std::shared_ptr<Role> role, int index = 0);

// Note [Roles live until exit]
// A role holds the communicators it gathers and reduces over (a ZeRO unit its
// dp group, a tp role its tp group), and so the rank's comm::Process, whose
// destructor says goodbye to the rendezvous store. The registry is a static:
// a program that returns from main destroys it, and the rank says goodbye
// then. One that ends with _Exit (the test harness's ranks) never does: its
// store connection closes without a goodbye and every rank still working, even
// in groups without it, is told that it died. Such a program calls forget_all()
// first. (Nothing knows when a module is destroyed, so a long-lived program
// that parallelizes many models keeps each one's roles and communicators.)
void forget_all();

struct Mark {
  std::shared_ptr<Role> role;
  int index = 0;
};
// The marks whose span t overlaps.
std::vector<Mark> marks_of(const at::Tensor& t);

// t.set_data(data), t's marks moving with it onto data's storage (set_data
// would drop the dispatch key, and the old storage would stay registered):
// ZeRO-1/2's flat buffer, a cast to bf16, on tp::parallelize'd parameters.
void set_data_keeping_marks(const at::Tensor& t, const at::Tensor& data);

// Adds `key` to the key set of t's TensorImpl (after any set_data, which copies key sets).
void add_dispatch_key(const at::Tensor& t, c10::DispatchKey key);

// The roles on t's storage, with their indices; empty for an unmarked tensor.
std::vector<std::pair<Role*, int>> roles_of(const at::Tensor& t);

// The first role of type R on t's span, or null.
template <typename R>
R* role_of(const at::Tensor& t) {
  for (const auto& r : roles_of(t))
    if (auto* role = dynamic_cast<R*>(r.first)) return role;
  return nullptr;
}

// The dispatch key marked tensors carry.
constexpr c10::DispatchKey kMarker = c10::DispatchKey::Fake;
// A second unused key, above autograd, for kernels that must act before
// autograd records an operation (tp::parallelize's; tp/cut.h). set_data_keeping_marks keeps it too.
constexpr c10::DispatchKey kAboveAutogradMarker = c10::DispatchKey::DeferredInit;

// While alive, operations on marked tensors go straight to their kernels (a
// role's own copies into and out of its tensors, outside the fallback).
class Bypass {
  c10::impl::ExcludeDispatchKeyGuard guard_{kMarker};
};

// Hands the operation to the kernels after the marker (inside Role::run).
void redispatch(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack);

}  // namespace intercept
}  // namespace meshtrain
