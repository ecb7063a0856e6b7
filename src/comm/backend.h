#pragma once
// Which backend a communicator runs on, and building one.
//
// MESHTRAIN_BACKEND (or CommOptions::backend) names the choice: gloo, shm, mpi
// or auto (the default). A job started by mpirun runs on MPI under auto or
// mpi: init_from_env makes an MPI world (no store) and its sub-communicators
// come from MPI_Comm_split (src/comm/mpi/); backend mpi anywhere else is a
// ConfigError. Otherwise ranks meet through the store, and under auto a
// communicator whose members all share a host gets the shared-memory backend;
// one spanning hosts with the same number of members (two or more) on each
// gets the hierarchical one (shared memory inside each host, Gloo between
// hosts); any other gets Gloo. Ranks publish their host identity through the
// store (Process::host_of); MESHTRAIN_HOST_ID overrides it, so tests make
// "hosts" on one machine.

#include <cstdint>
#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "meshtrain/comm.h"

namespace meshtrain {
namespace comm {

class Process;

enum class BackendKind { kAuto, kGloo, kShm, kMpi };
enum class Impl { kGloo, kShm, kHierarchical };

// "gloo" -> kGloo...; ConfigError naming `source` (e.g. "MESHTRAIN_BACKEND") for anything else.
BackendKind parse_backend(const std::string& name, const std::string& source);
// CommOptions::backend when set, else MESHTRAIN_BACKEND, else auto.
BackendKind requested_backend(const CommOptions& options);
// The store-based implementation for members on these hosts (one entry per
// member, in rank order). ConfigError when `kind` is shm and the members span
// hosts, and always for mpi (MPI communicators are not made through the store).
Impl choose_impl(BackendKind kind, const std::vector<std::string>& member_hosts, const std::string& label);
const char* impl_name(Impl impl);

// Builds the communicator of `global_ranks` (this process is global_ranks[rank])
// on the backend choose_impl picks. `prefix` namespaces its store keys.
CommPtr make_communicator(std::shared_ptr<Process> process, std::vector<int> global_ranks, int rank,
                          const std::string& prefix, CommOptions options);

// The group a split(color, key) puts this rank in: its members' global ranks
// ordered by (key, rank) and this rank's place among them. Collective over
// `parent` (one all_gather); nullopt for color < 0.
struct SplitGroup {
  std::vector<int> global_ranks;
  int rank = -1;
};
std::optional<SplitGroup> split_group(Communicator& parent, int color, int key);
// The same from every member's (color, key), gathered: pairs is [parent.size(), 2] int64.
std::optional<SplitGroup> split_group_of(const at::Tensor& pairs, const Communicator& parent, int color);
// Communicator::split for the store-based backends: split_group, then
// make_communicator under "<prefix>/s<split_id>c<color>" (split_id counts the
// parent's splits, on every member).
CommPtr split_communicator(Communicator& parent, const std::shared_ptr<Process>& process, const std::string& prefix,
                           int split_id, int color, int key, const std::string& label);

// Cores this process may run on (its affinity mask).
int available_cores();

}  // namespace comm
}  // namespace meshtrain
