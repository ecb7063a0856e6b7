#include "meshtrain/dp/gradient_sync.h"

#include <map>
#include <mutex>

namespace meshtrain {
namespace dp {

namespace {

struct Registration {
  std::weak_ptr<void> owner;
  std::function<void(bool)> set_sync;
};

std::mutex& registry_mutex() {
  static std::mutex m;
  return m;
}

std::map<const torch::nn::Module*, Registration>& registry() {
  static std::map<const torch::nn::Module*, Registration> r;
  return r;
}

}  // namespace

void register_gradient_sync(const torch::nn::Module* module, std::weak_ptr<void> owner,
                            std::function<void(bool)> set_sync) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  registry()[module] = Registration{std::move(owner), std::move(set_sync)};
}

void unregister_gradient_sync(const torch::nn::Module* module) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  registry().erase(module);
}

bool set_gradient_sync(const torch::nn::Module& module, bool on) {
  std::function<void(bool)> set;
  std::shared_ptr<void> alive;
  {
    std::lock_guard<std::mutex> lock(registry_mutex());
    auto it = registry().find(&module);
    if (it == registry().end()) return false;
    alive = it->second.owner.lock();
    if (!alive) return false;
    set = it->second.set_sync;
  }
  set(on);
  return true;
}

}  // namespace dp
}  // namespace meshtrain
