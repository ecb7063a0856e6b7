#include "meshtrain/comm.h"

#include <ATen/Parallel.h>

#include <dlfcn.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <thread>

#include "backend.h"
#include "mpi/world.h"
#include "process.h"
#include "comm/store.h"
#include "meshtrain/util.h"
#include "util/memory.h"
#include "util/strings.h"
#include "socket.h"

namespace meshtrain {
namespace comm {

namespace {

int parse_int(const EnvLookup& lookup, const std::string& name, std::optional<int> fallback) {
  auto v = lookup(name);
  if (!v || v->empty()) {
    MESHTRAIN_CHECK(fallback.has_value(), "environment variable ", name,
                    " is not set; launch with meshrun (or torchrun, mpirun, srun), or set it");
    return *fallback;
  }
  try {
    size_t pos = 0;
    const long long x = std::stoll(*v, &pos);
    MESHTRAIN_CHECK(pos == v->size(), "");
    MESHTRAIN_CHECK(x >= -1 && x <= (1LL << 30), "");
    return static_cast<int>(x);
  } catch (const std::exception&) {
    throw ConfigError(str_cat("environment variable ", name, "='", *v,
                              "' is not a valid integer"));
  }
}

std::string get_or(const EnvLookup& lookup, const std::string& name, const std::string& dflt) {
  auto v = lookup(name);
  return v && !v->empty() ? *v : dflt;
}

void validate(const DistEnv& e, const std::string& rank_var, const std::string& size_var,
              const std::string& local_var, const std::string& local_size_var) {
  MESHTRAIN_CHECK(e.world_size >= 1, size_var, "=", e.world_size, " must be at least 1");
  MESHTRAIN_CHECK(e.rank >= 0 && e.rank < e.world_size, rank_var, "=", e.rank,
                  " must be in [0, ", size_var, "=", e.world_size, ")");
  MESHTRAIN_CHECK(e.local_world_size >= 1 && e.local_world_size <= e.world_size, local_size_var,
                  "=", e.local_world_size, " must be in [1, ", size_var, "=", e.world_size, "]");
  MESHTRAIN_CHECK(e.local_rank >= 0 && e.local_rank < e.local_world_size, local_var, "=",
                  e.local_rank, " must be in [0, ", local_size_var, "=", e.local_world_size, ")");
  MESHTRAIN_CHECK(e.master_port >= 1 && e.master_port <= 65535, "MASTER_PORT=", e.master_port,
                  " must be in [1, 65535]");
}

// A multi-node mpirun job whose ranks meet through the store must say where it is.
void require_master_addr_across_nodes(const DistEnv& e) {
  MESHTRAIN_CHECK(!e.master_addr.empty() || e.world_size == e.local_world_size,
                  "MASTER_ADDR is not set and the mpirun job spans several nodes, with a backend that meets through "
                  "the rendezvous store; pass it, e.g. mpirun -x MASTER_ADDR=<host of rank 0> -x MASTER_PORT=29500, "
                  "or use MESHTRAIN_BACKEND=mpi (or auto), which needs no store");
}

}  // namespace

int slurm_tasks_on_node(const std::string& spec, int node) {
  // "2(x3),1": 2 tasks on each of the first three nodes, then 1.
  int seen = 0;
  for (const std::string& part : split(spec, ',')) {
    int tasks = 0, repeat = 1;
    char rest = 0;
    const int n = std::sscanf(part.c_str(), "%d(x%d%c", &tasks, &repeat, &rest);
    MESHTRAIN_CHECK((n == 1 && part.find('(') == std::string::npos) || (n == 3 && rest == ')'),
                    "Slurm's tasks per node '", spec, "' is malformed at '", part,
                    "'; expected counts like 2(x3),1 (or set LOCAL_WORLD_SIZE)");
    MESHTRAIN_CHECK(tasks >= 1 && repeat >= 1, "Slurm's tasks per node '", spec, "' has a count below 1");
    if (node < seen + repeat) return tasks;
    seen += repeat;
  }
  throw ConfigError(str_cat("SLURM_NODEID=", node, " is past the ", seen, " nodes of Slurm's tasks per node '", spec,
                            "'"));
}

std::string first_host_of_nodelist(const std::string& nodelist) {
  MESHTRAIN_CHECK(!nodelist.empty(), "SLURM_JOB_NODELIST is empty; set MASTER_ADDR");
  // The first entry ends at a comma outside brackets.
  size_t end = 0;
  int depth = 0;
  for (; end < nodelist.size(); ++end) {
    if (nodelist[end] == '[') ++depth;
    if (nodelist[end] == ']') --depth;
    if (nodelist[end] == ',' && depth == 0) break;
  }
  const std::string first = nodelist.substr(0, end);
  const size_t open = first.find('[');
  if (open == std::string::npos) return first;
  const size_t close = first.find(']', open);
  MESHTRAIN_CHECK(close != std::string::npos, "malformed Slurm node list '", nodelist,
                  "'; set MASTER_ADDR");
  std::string range = first.substr(open + 1, close - open - 1);
  range = range.substr(0, range.find_first_of(",-"));  // the first index, zero padding kept
  MESHTRAIN_CHECK(!range.empty(), "malformed Slurm node list '", nodelist, "'; set MASTER_ADDR");
  return first.substr(0, open) + range + first.substr(close + 1);
}

std::pair<std::string, int> parse_tcp_url(const std::string& url) {
  const std::string scheme = "tcp://";
  MESHTRAIN_CHECK(url.compare(0, scheme.size(), scheme) == 0, "init method '", url,
                  "' must look like tcp://host:port");
  std::string rest = url.substr(scheme.size());
  std::string host;
  std::string port_str;
  if (!rest.empty() && rest[0] == '[') {
    const size_t close = rest.find(']');
    MESHTRAIN_CHECK(close != std::string::npos && close + 1 < rest.size() && rest[close + 1] == ':',
                    "init method '", url, "': an IPv6 host must look like tcp://[::1]:port");
    host = rest.substr(1, close - 1);
    port_str = rest.substr(close + 2);
  } else {
    const size_t colon = rest.rfind(':');
    MESHTRAIN_CHECK(colon != std::string::npos, "init method '", url,
                    "' has no port; it must look like tcp://host:port");
    host = rest.substr(0, colon);
    port_str = rest.substr(colon + 1);
  }
  MESHTRAIN_CHECK(!host.empty(), "init method '", url, "' has an empty host");
  int port = -1;
  try {
    size_t pos = 0;
    port = std::stoi(port_str, &pos);
    if (pos != port_str.size()) port = -1;
  } catch (const std::exception&) {
    port = -1;
  }
  MESHTRAIN_CHECK(port >= 1 && port <= 65535, "init method '", url, "': port '", port_str,
                  "' must be an integer in [1, 65535]");
  return {host, port};
}

DistEnv parse_dist_env(const EnvLookup& lookup) {
  DistEnv e;
  e.master_addr = get_or(lookup, "MASTER_ADDR", "");
  e.master_port = parse_int(lookup, "MASTER_PORT", 29500);
  e.agent_store = get_or(lookup, "MESHTRAIN_AGENT_STORE", "0") == "1";
  e.restart_count = parse_int(lookup, "MESHTRAIN_RESTART_COUNT", 0);
  if (lookup("RANK") || lookup("WORLD_SIZE")) {
    e.source = "torchrun";
    e.rank = parse_int(lookup, "RANK", std::nullopt);
    e.world_size = parse_int(lookup, "WORLD_SIZE", std::nullopt);
    e.local_rank = parse_int(lookup, "LOCAL_RANK", e.rank);
    e.local_world_size = parse_int(lookup, "LOCAL_WORLD_SIZE", e.world_size);
    MESHTRAIN_CHECK(!e.master_addr.empty() || e.world_size == e.local_world_size,
                    "MASTER_ADDR is not set and the job spans several nodes (WORLD_SIZE=",
                    e.world_size, ", LOCAL_WORLD_SIZE=", e.local_world_size,
                    "); set MASTER_ADDR to rank 0's host");
    validate(e, "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE");
  } else if (lookup("OMPI_COMM_WORLD_RANK")) {
    e.source = "openmpi";
    e.rank = parse_int(lookup, "OMPI_COMM_WORLD_RANK", std::nullopt);
    e.world_size = parse_int(lookup, "OMPI_COMM_WORLD_SIZE", std::nullopt);
    e.local_rank = parse_int(lookup, "OMPI_COMM_WORLD_LOCAL_RANK", 0);
    e.local_world_size = parse_int(lookup, "OMPI_COMM_WORLD_LOCAL_SIZE", e.world_size);
    // Under mpirun the world is MPI's (auto or mpi: no store); only the store's backends need its address.
    const std::string backend = get_or(lookup, "MESHTRAIN_BACKEND", "auto");
    if (backend != "auto" && backend != "mpi") require_master_addr_across_nodes(e);
    validate(e, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
             "OMPI_COMM_WORLD_LOCAL_SIZE");
  } else if (lookup("SLURM_PROCID")) {
    e.source = "slurm";
    e.rank = parse_int(lookup, "SLURM_PROCID", std::nullopt);
    e.world_size = parse_int(lookup, "SLURM_NTASKS", std::nullopt);
    e.local_rank = parse_int(lookup, "SLURM_LOCALID", 0);
    // SLURM_TASKS_PER_NODE ("2(x3),1") is always set and may differ by node;
    // SLURM_NTASKS_PER_NODE only with --ntasks-per-node.
    const std::string per_node = get_or(lookup, "SLURM_TASKS_PER_NODE", get_or(lookup, "SLURM_NTASKS_PER_NODE", ""));
    e.local_world_size =
        per_node.empty() ? e.world_size : slurm_tasks_on_node(per_node, parse_int(lookup, "SLURM_NODEID", 0));
    if (e.master_addr.empty()) {
      const std::string nodes = get_or(lookup, "SLURM_JOB_NODELIST", get_or(lookup, "SLURM_NODELIST", ""));
      MESHTRAIN_CHECK(!nodes.empty() || e.world_size == e.local_world_size,
                      "neither MASTER_ADDR nor SLURM_JOB_NODELIST is set; set MASTER_ADDR");
      e.master_addr = nodes.empty() ? "127.0.0.1" : first_host_of_nodelist(nodes);
    }
    validate(e, "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_TASKS_PER_NODE");
  } else {
    e.source = "single";
  }
  if (e.master_addr.empty()) e.master_addr = "127.0.0.1";
  return e;
}

DistEnv dist_env_from_process() {
  return parse_dist_env([](const std::string& name) -> std::optional<std::string> {
    const char* v = std::getenv(name.c_str());
    if (!v) return std::nullopt;
    return std::string(v);
  });
}

namespace {

// OpenBLAS sizes its own thread pool when it is loaded, from OPENBLAS_NUM_THREADS
// or OMP_NUM_THREADS; a rank started without either needs the runtime setter.
// Looked up dynamically: libblas.so.3 may be another BLAS, which lacks it.
void set_openblas_threads(int n) {
  using Setter = void (*)(int);
  if (auto setter = reinterpret_cast<Setter>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"))) {
    setter(n);
  }
}

}  // namespace

void apply_thread_settings() { apply_thread_settings(dist_env_from_process()); }

void set_compute_threads(int n) {
  MESHTRAIN_CHECK(n >= 1, "set_compute_threads: ", n, " threads; give at least 1");
  at::set_num_threads(n);
  set_openblas_threads(n);
}

void apply_thread_settings(const DistEnv& e) {
  const char* omp = std::getenv("OMP_NUM_THREADS");
  if (omp) {
    const int n = std::atoi(omp);
    if (n > 0) at::set_num_threads(n);
    return;
  }
  // Started without meshrun (mpirun, srun) and without OMP_NUM_THREADS: give
  // each rank its share of the node's cores, as meshrun and torchrun do.
  if (e.local_world_size > 1) {
    const int cores = static_cast<int>(std::thread::hardware_concurrency());
    const int share = std::max(1, cores / e.local_world_size);
    at::set_num_threads(share);
    set_openblas_threads(share);
  }
}

namespace {

// Where the transport binds: MESHTRAIN_BIND_ADDR, else the local address that
// routes to the master (loopback for a one-node job).
std::string bind_address(const std::string& master_addr) {
  const char* env = std::getenv("MESHTRAIN_BIND_ADDR");
  if (env && *env) return env;
  return net::local_address_towards(master_addr);
}

// Where and as whom a process joins its world.
struct JoinSpec {
  std::string host;
  int port = 0;
  int rank = 0;
  int world_size = 1;
  std::string group;
  bool host_store = false;      // rank 0 without a launcher
  bool report_startup = true;   // Note [Start-up reports]: not under meshrun
};

// Set once this process told its store why it stops, or found it cannot (Note [Start-up reports]).
std::atomic<bool> g_startup_reported{false};

CommPtr init_from_env_or_throw(CommOptions options);

// Posts a start-up error on the store connection of a process that has one.
void report_startup(TcpStore& store, const JoinSpec& spec, const std::string& message) {
  g_startup_reported = true;
  try {
    store.report_failure(str_cat(spec.group, "/startup/r", spec.rank), kStartupReport + message);
    store.bye();  // the error is the news, not a dead connection
  } catch (const std::exception&) {  // the store went away: the others learn of it on their own
  }
}

// Rank 0 hosts the store; a port already held is most often a second rank 0.
std::unique_ptr<StoreServer> host_the_store(const JoinSpec& spec) {
  try {
    return std::make_unique<StoreServer>(spec.host, spec.port);
  } catch (const ConfigError& e) {
    throw ConfigError(str_cat("rank 0 cannot host the rendezvous store: ", e.what(), " (if another rank 0 of this job ",
                              "holds it, two processes were given RANK=0)"));
  }
}

CommPtr join(const JoinSpec& spec, CommOptions options) {
  requested_backend(options);  // a bad backend name fails here, before any connection
  MESHTRAIN_CHECK(spec.world_size >= 1, "world size ", spec.world_size, " must be at least 1");
  MESHTRAIN_CHECK(spec.rank >= 0 && spec.rank < spec.world_size, "rank ", spec.rank, " must be in [0, world size ",
                  spec.world_size, ")");
  std::unique_ptr<StoreServer> server = spec.host_store ? host_the_store(spec) : nullptr;
  const int store_port = server ? server->port() : spec.port;
  std::shared_ptr<TcpStore> store;
  try {
    store = std::make_shared<TcpStore>(spec.host, store_port, options.timeout);
  } catch (const ConfigError&) {  // refused for its token: nothing this process says would be taken
    g_startup_reported = true;
    throw;
  }
  ProcessConfig config;
  config.rank = spec.rank;
  config.world_size = spec.world_size;
  config.group = spec.group;
  config.bind_host = bind_address(spec.host);
  config.host_id = host_identity();
  config.timeout = options.timeout;
  std::vector<int> ranks(spec.world_size);
  for (int r = 0; r < spec.world_size; ++r) ranks[r] = r;
  std::shared_ptr<Process> process;
  try {
    process = std::make_shared<Process>(config, store, std::move(server));
    CommPtr world = make_communicator(process, ranks, spec.rank, spec.group + "/world", std::move(options));
    process->rendezvous_done();
    return world;
  } catch (const ConfigError& e) {
    store->set_interrupt(nullptr);  // it may point into a Process that was never made
    if (spec.report_startup) report_startup(*store, spec, e.what());
    throw;
  } catch (...) {
    store->set_interrupt(nullptr);
    throw;
  }
}

}  // namespace

CommPtr init_from_env(CommOptions options) {
  try {
    return init_from_env_or_throw(std::move(options));
  } catch (const ConfigError& e) {
    report_startup_error(e.what());  // a no-op when join() posted it already
    throw;
  }
}

namespace {

CommPtr init_from_env_or_throw(CommOptions options) {
  const DistEnv e = dist_env_from_process();
  const BackendKind kind = requested_backend(options);
  const bool under_mpirun = e.source == "openmpi";
  MESHTRAIN_CHECK(kind != BackendKind::kMpi || under_mpirun, "backend mpi: this process was not started by mpirun "
                  "(OMPI_COMM_WORLD_RANK is not set, the launcher is '", e.source, "'); start the job with "
                  "mpirun -np <ranks> <program>, or use MESHTRAIN_BACKEND=auto, shm or gloo");
  apply_thread_settings(e);
  keep_freed_memory_for_reuse();  // Note [Freed memory kept for reuse]
  if (kind == BackendKind::kMpi || (kind == BackendKind::kAuto && under_mpirun)) {
    return mpi_backend::make_world(std::move(options));
  }
  if (under_mpirun) {  // a store-based backend asked for by CommOptions::backend (parse_dist_env saw only the env)
    DistEnv given = e;
    if (!std::getenv("MASTER_ADDR")) given.master_addr.clear();  // parse_dist_env defaulted it to loopback
    require_master_addr_across_nodes(given);
  }
  if (e.source == "single") {
    // A world of one still runs through the same code path, with a private store.
    return make_single_process_world(std::move(options));
  }
  JoinSpec spec;
  spec.host = e.master_addr;
  spec.port = e.master_port;
  spec.rank = e.rank;
  spec.world_size = e.world_size;
  spec.group = str_cat("g", e.restart_count);
  spec.host_store = !e.agent_store && e.rank == 0;
  spec.report_startup = !e.agent_store;
  return join(spec, std::move(options));
}

}  // namespace

CommPtr make_single_process_world(CommOptions options) {
  JoinSpec spec;
  spec.host = "127.0.0.1";
  spec.group = "single";
  spec.host_store = true;
  return join(spec, std::move(options));
}

CommPtr init_tcp(const std::string& url, int rank, int world_size, CommOptions options) {
  const auto hp = parse_tcp_url(url);
  JoinSpec spec;
  spec.host = hp.first;
  spec.port = hp.second;
  spec.rank = rank;
  spec.world_size = world_size;
  spec.group = "tcp";
  spec.host_store = rank == 0;
  return join(spec, std::move(options));
}

CommPtr init_with_store(const std::string& host, int port, int rank, int world_size,
                        const std::string& group, CommOptions options) {
  JoinSpec spec;
  spec.host = host;
  spec.port = port;
  spec.rank = rank;
  spec.world_size = world_size;
  spec.group = group;
  return join(spec, std::move(options));
}

namespace {

std::string env_or(const char* name, const std::string& fallback) {
  const char* v = std::getenv(name);
  return v && *v ? v : fallback;
}

// Whether a process accepts connections at host:port now (one attempt).
bool store_answers(const std::string& host, int port) {
  try {
    ::close(net::connect_to(host, port, net::Clock::now(), "the rendezvous store"));
    return true;
  } catch (const std::exception&) {
    return false;
  }
}

}  // namespace

void report_startup_error(const std::string& message) {
  if (g_startup_reported.exchange(true)) return;
  try {
    const std::string rank = env_or("RANK", ""), world = env_or("WORLD_SIZE", "");
    if ((rank.empty() && world.empty()) || world == "1" || env_or("MESHTRAIN_AGENT_STORE", "0") == "1") return;
    const std::string host = env_or("MASTER_ADDR", "127.0.0.1");
    const int port = std::atoi(env_or("MASTER_PORT", "29500").c_str());
    if (port < 1 || port > 65535) return;
    // Rank 0 would have hosted the store: one answers only when another
    // process holds the port (a second rank 0), so it is not waited for.
    if (rank == "0" && !store_answers(host, port)) return;
    TcpStore store(host, port, std::chrono::seconds(3));
    char name[256] = {0};
    gethostname(name, sizeof name - 1);
    const std::string group = str_cat("g", std::atoi(env_or("MESHTRAIN_RESTART_COUNT", "0").c_str()));
    store.report_failure(group + "/startup", str_cat(kStartupReport, message, " (a process started with RANK=",
                                                     rank.empty() ? "(unset)" : rank, " on host ", name, ", pid ",
                                                     getpid(), ")"));
    store.bye();
  } catch (const std::exception&) {  // no store, or one that refuses this process: the others' time-outs tell
  }
}

}  // namespace comm
}  // namespace meshtrain
