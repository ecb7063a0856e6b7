#pragma once
// Joining a job. A process learns its rank, the world size and where the
// rendezvous store is from (in this order of precedence):
//   1. torchrun-style variables: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
//      MASTER_ADDR, MASTER_PORT (set by meshrun and torchrun);
//   2. OpenMPI's: OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK, _LOCAL_SIZE
//      (MASTER_ADDR defaults to 127.0.0.1 when the job is on one node);
//   3. Slurm's: SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID (master: MASTER_ADDR,
//      else the first host of SLURM_JOB_NODELIST);
//   4. none of these: a world of one process.
// or explicitly with the article's init method "tcp://host:port" plus a rank
// and a world size. Rank 0 hosts the store at MASTER_ADDR:MASTER_PORT (bound to
// that address only), unless the launcher hosts it (MESHTRAIN_AGENT_STORE=1).
// A job started by mpirun runs on MPI (backend auto or mpi) and needs no store.

#include <functional>
#include <optional>
#include <string>

#include "meshtrain/comm/communicator.h"

namespace meshtrain {
namespace comm {

struct DistEnv {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  // Which convention the values came from: "torchrun", "openmpi", "slurm", "single".
  std::string source = "single";
  // The launcher hosts the store; ranks only connect to it.
  bool agent_store = false;
  // Restart generation under meshrun (namespaces the store between attempts).
  int restart_count = 0;
};

using EnvLookup = std::function<std::optional<std::string>(const std::string&)>;

// Reads the variables through `lookup` (pure, for tests). Throws ConfigError
// naming the variable when values are missing, malformed or contradictory.
DistEnv parse_dist_env(const EnvLookup& lookup);
// The process environment.
DistEnv dist_env_from_process();
// "node[01-03,07],gpu5" -> "node01". Throws ConfigError on a malformed list.
std::string first_host_of_nodelist(const std::string& nodelist);
// Tasks on node `node` of Slurm's SLURM_TASKS_PER_NODE, e.g. "2(x3),1" -> 2 for nodes 0-2, 1 for node 3.
int slurm_tasks_on_node(const std::string& spec, int node);
// Parses "tcp://host:port" (IPv6 hosts in brackets). Throws ConfigError.
std::pair<std::string, int> parse_tcp_url(const std::string& url);

// Sets the intra-op thread count from OMP_NUM_THREADS (meshrun sets it to this
// rank's share of the cores), so BLAS and ATen threads do not oversubscribe;
// without it, to the share of the cores `env` gives this rank's node.
void apply_thread_settings(const DistEnv& env);
void apply_thread_settings();  // of this process's environment
// libtorch's intra-op threads and OpenBLAS's pool (when libblas.so.3 is
// OpenBLAS) set to n.
void set_compute_threads(int n);

// Joins the job described by the environment; returns the world communicator.
// Under mpirun with backend auto or mpi (CommOptions::backend, else
// MESHTRAIN_BACKEND), an MPI world; backend mpi without mpirun is a ConfigError.
CommPtr init_from_env(CommOptions options = {});
// Ends MPI in this process (MPI_Finalize), if meshtrain started it and its
// state allows (see docs/comm.md). It happens at normal exit anyway; call it
// in a process that ends with _exit, after its last communicator is gone
// (ConfigError otherwise). Every rank of the job must reach it. No-op without MPI.
void finalize_mpi();
// The article's init method: rank 0 hosts the store at host:port.
CommPtr init_tcp(const std::string& url, int rank, int world_size, CommOptions options = {});
// A world of one process (its own private store): single-process references.
CommPtr make_single_process_world(CommOptions options = {});
// Joins through a store that is already running at host:port (launchers, tests).
// `group` namespaces this job attempt's keys and failure labels.
CommPtr init_with_store(const std::string& host, int port, int rank, int world_size,
                        const std::string& group, CommOptions options = {});

// Posts `message`, an error that stops this process before its world is made
// (a ConfigError), to the job's rendezvous store, so that the ranks waiting
// there end now naming it instead of at their communication time-out (Note
// [Start-up reports] in src/comm/process.cpp). Only for ranks started with
// torchrun's variables and no launcher (RANK or WORLD_SIZE set, WORLD_SIZE not
// 1, MESHTRAIN_AGENT_STORE unset: meshrun sees its ranks exit itself), when
// the store at MASTER_ADDR:MASTER_PORT answers within a few seconds and takes
// this process's MESHTRAIN_RDZV_TOKEN; once per process (init_from_env posts
// its own errors). Never throws.
void report_startup_error(const std::string& message);

}  // namespace comm
}  // namespace meshtrain
