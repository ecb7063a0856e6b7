#include "communicator.h"

#include "../gloo/communicator.h"
#include "../process.h"

namespace meshtrain {
namespace comm {
namespace hier_backend {

CommPtr make_hierarchical(std::shared_ptr<Process> process, std::vector<int> global_ranks, int rank,
                          const std::string& prefix, CommOptions options) {
  return std::make_shared<gloo_backend::GlooCommunicator>(process, std::move(global_ranks), rank, prefix,
                                                          std::move(options));
}

}  // namespace hier_backend
}  // namespace comm
}  // namespace meshtrain
