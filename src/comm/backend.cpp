#include "backend.h"

#include <sched.h>
#include <unistd.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdlib>
#include <map>

#include "tcp/communicator.h"
#include "hier/communicator.h"
#include "meshtrain/util.h"
#include "process.h"
#include "shm/communicator.h"
#include "tuning_env.h"

namespace meshtrain {
namespace comm {

BackendKind parse_backend(const std::string& name, const std::string& source) {
  if (name == "auto") return BackendKind::kAuto;
  // "gloo" as PyTorch names its CPU backend; "tcp" says what it is (no byte goes through libgloo).
  if (name == "gloo" || name == "tcp") return BackendKind::kGloo;
  if (name == "shm") return BackendKind::kShm;
  if (name == "mpi") return BackendKind::kMpi;
  throw ConfigError(str_cat(source, " '", name, "' is not a backend; use auto, shm, gloo (also called tcp) or mpi"));
}

BackendKind requested_backend(const CommOptions& options) {
  if (!options.backend.empty()) return parse_backend(options.backend, "backend");
  const std::string env = backend_from_env();
  if (!env.empty()) return parse_backend(env, "MESHTRAIN_BACKEND");
  return BackendKind::kAuto;
}

Impl choose_impl(BackendKind kind, const std::vector<std::string>& member_hosts, const std::string& label) {
  std::map<std::string, int> per_host;
  for (const auto& h : member_hosts) ++per_host[h];
  const bool one_host = per_host.size() <= 1;
  switch (kind) {
    case BackendKind::kGloo:
      return Impl::kGloo;
    case BackendKind::kShm:
      MESHTRAIN_CHECK(one_host, "backend shm: communicator '", label, "' spans ", per_host.size(),
                      " hosts, and shared memory reaches only the ranks of one host; use backend auto "
                      "(shared memory inside hosts, Gloo between them) or gloo");
      return Impl::kShm;
    case BackendKind::kMpi:
      // MPI communicators come only from init_from_env under mpirun, and their
      // splits from MPI_Comm_split; this is the store's path (init_tcp,
      // init_with_store, the splits of a shm or gloo world).
      throw ConfigError(str_cat("backend mpi: communicator '", label, "' is being made through the rendezvous "
                                "store, which only the shm and gloo backends use; an MPI world comes from "
                                "init_from_env() in a process started by mpirun (mpirun -np <ranks> <program>), "
                                "and its sub-communicators are MPI too; or use backend auto, shm or gloo"));
    case BackendKind::kAuto:
      break;
  }
  if (one_host) return Impl::kShm;
  const int local = per_host.begin()->second;
  const bool even = std::all_of(per_host.begin(), per_host.end(), [&](const auto& kv) { return kv.second == local; });
  return even && local >= 2 ? Impl::kHierarchical : Impl::kGloo;
}

const char* impl_name(Impl impl) {
  switch (impl) {
    case Impl::kGloo: return "gloo";
    case Impl::kShm: return "shm";
    case Impl::kHierarchical: return "hierarchical";
  }
  return "?";
}

namespace {

const char* backend_name(BackendKind kind) {
  switch (kind) {
    case BackendKind::kAuto: return "auto";
    case BackendKind::kGloo: return "gloo";
    case BackendKind::kShm: return "shm";
    case BackendKind::kMpi: return "mpi";
  }
  return "?";
}

// Note [Backends agreed]: members that ask for different backends would each
// build their own transport and wait for peers that never come (a shared-memory
// segment mapped by one side, a Gloo address published by the other) until the
// communication timeout, naming neither. So every member publishes what it asked
// for under the communicator's prefix and compares with the others' before any
// transport exists: a mismatch is a ConfigError on every member, at once.
void agree_on_backend(Process& process, const std::vector<int>& global_ranks, int rank, const std::string& prefix,
                      BackendKind mine, const std::string& label) {
  if (global_ranks.size() < 2) return;
  const std::string key = prefix + "/backend/";
  process.store()->set(key + std::to_string(rank), backend_name(mine));
  for (size_t r = 0; r < global_ranks.size(); ++r) {
    if (static_cast<int>(r) == rank) continue;
    const std::string theirs = process.store()->get(key + std::to_string(r));
    MESHTRAIN_CHECK(theirs == backend_name(mine), "communicator '", label, "': global rank ", global_ranks[r],
                    " asked for backend '", theirs, "' and this rank (global rank ", global_ranks[rank], ") for '",
                    backend_name(mine), "'; set the same MESHTRAIN_BACKEND (or --backend, CommOptions::backend) on ",
                    "every rank and node, or none (auto)");
  }
}

}  // namespace

CommPtr make_communicator(std::shared_ptr<Process> process, std::vector<int> global_ranks, int rank,
                          const std::string& prefix, CommOptions options) {
  std::vector<std::string> hosts;
  for (int g : global_ranks) hosts.push_back(process->host_of(g));
  const BackendKind kind = requested_backend(options);
  agree_on_backend(*process, global_ranks, rank, prefix, kind, options.label);
  switch (choose_impl(kind, hosts, options.label)) {
    case Impl::kShm:
      return std::make_shared<shm_backend::ShmCommunicator>(process, std::move(global_ranks), rank, prefix,
                                                            std::move(options));
    case Impl::kHierarchical:
      return std::make_shared<hier_backend::HierCommunicator>(process, std::move(global_ranks), rank, prefix,
                                                              std::move(options));
    case Impl::kGloo:
      break;
  }
  return std::make_shared<gloo_backend::TcpCommunicator>(process, std::move(global_ranks), rank, prefix,
                                                          std::move(options));
}

std::optional<SplitGroup> split_group(Communicator& parent, int color, int key) {
  at::Tensor mine = at::tensor({static_cast<int64_t>(color), static_cast<int64_t>(key)}, at::kLong);
  return split_group_of(parent.all_gather_flat(mine).view({parent.size(), 2}), parent, color);
}

std::optional<SplitGroup> split_group_of(const at::Tensor& pairs, const Communicator& parent, int color) {
  if (color < 0) return std::nullopt;
  auto a = pairs.accessor<int64_t, 2>();
  std::vector<std::pair<int64_t, int>> members;  // (key, rank)
  for (int r = 0; r < parent.size(); ++r) {
    if (a[r][0] == color) members.emplace_back(a[r][1], r);
  }
  std::sort(members.begin(), members.end());
  SplitGroup group;
  for (size_t i = 0; i < members.size(); ++i) {
    if (members[i].second == parent.rank()) group.rank = static_cast<int>(i);
    group.global_ranks.push_back(parent.global_ranks()[members[i].second]);
  }
  return group;
}

CommPtr split_communicator(Communicator& parent, const std::shared_ptr<Process>& process, const std::string& prefix,
                           int split_id, int color, int key, const std::string& label) {
  auto group = split_group(parent, color, key);
  if (!group) return nullptr;
  CommOptions options = parent.options();
  options.label = label;
  return make_communicator(process, std::move(group->global_ranks), group->rank,
                           str_cat(prefix, "/s", split_id, "c", color), std::move(options));
}

int available_cores() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) == 0) return CPU_COUNT(&set);
  return static_cast<int>(sysconf(_SC_NPROCESSORS_ONLN));
}

}  // namespace comm
}  // namespace meshtrain
