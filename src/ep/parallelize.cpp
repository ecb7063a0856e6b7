// ep::parallelize: see the header. The layers do the slicing
// (nn::ExpertParallel); the group they get exchanges over the communicator.
#include "meshtrain/ep.h"

#include <string>
#include <vector>

#include "ep/all_to_all.h"
#include "meshtrain/util.h"

namespace meshtrain {
namespace ep {

CommExpertGroup::CommExpertGroup(comm::CommPtr comm) : comm_(std::move(comm)) {
  MESHTRAIN_CHECK(comm_, "ep::CommExpertGroup needs a communicator");
}

nn::Exchanged CommExpertGroup::exchange(const at::Tensor& rows, const std::vector<int64_t>& send_counts) {
  return all_to_all_rows(rows, send_counts, comm_);
}

comm::CommPtr communicator_of(const nn::ExpertGroup& group) {
  const auto* mine = dynamic_cast<const CommExpertGroup*>(&group);
  return mine ? mine->communicator() : nullptr;
}

int parallelize(torch::nn::Module& model, const comm::CommPtr& ep) {
  if (!ep || ep->size() == 1) return 0;
  std::vector<nn::ExpertParallel*> layers;
  for (const auto& item : model.named_modules()) {  // all checked before anything changes
    auto* layer = dynamic_cast<nn::ExpertParallel*>(item.value().get());
    if (!layer) continue;
    MESHTRAIN_CHECK(!layer->expert_group(), "ep::parallelize: the experts of '", item.key(), "' are already spread "
                    "over a group; parallelize a model once");
    expert_slice(layer->num_experts(), ep->size(), ep->rank());  // ConfigError naming the valid choices
    layers.push_back(layer);
  }
  const auto group = std::make_shared<CommExpertGroup>(ep);
  for (nn::ExpertParallel* layer : layers) layer->parallelize_experts(group);
  return static_cast<int>(layers.size());
}

}  // namespace ep
}  // namespace meshtrain
