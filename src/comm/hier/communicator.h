#pragma once
// The hierarchical communicator: members on several hosts, the same number on
// each. See communicator.cpp.

#include <memory>
#include <string>
#include <vector>

#include "meshtrain/comm/communicator.h"

namespace meshtrain {
namespace comm {

class Process;

namespace hier_backend {

CommPtr make_hierarchical(std::shared_ptr<Process> process, std::vector<int> global_ranks, int rank,
                          const std::string& prefix, CommOptions options);

}  // namespace hier_backend
}  // namespace comm
}  // namespace meshtrain
