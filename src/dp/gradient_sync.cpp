#include "dp/gradient_sync.h"

#include <map>
#include <mutex>
#include <vector>

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

bool has_gradient_sync(const torch::nn::Module& module) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  auto it = registry().find(&module);
  return it != registry().end() && !it->second.owner.expired();
}

bool set_gradient_sync(const torch::nn::Module& module, bool on) {
  std::vector<const torch::nn::Module*> tree{&module};
  for (const auto& m : module.modules(/*include_self=*/false)) tree.push_back(m.get());
  std::vector<std::pair<std::shared_ptr<void>, std::function<void(bool)>>> live;
  {
    std::lock_guard<std::mutex> lock(registry_mutex());
    for (const torch::nn::Module* m : tree) {
      auto it = registry().find(m);
      if (it == registry().end()) continue;
      if (auto alive = it->second.owner.lock()) live.emplace_back(std::move(alive), it->second.set_sync);
    }
  }
  for (auto& l : live) l.second(on);  // outside the lock: a wrapper may register or query
  return !live.empty();
}

}  // namespace dp
}  // namespace meshtrain
