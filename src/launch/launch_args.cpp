// meshrun's argument parsing and per-rank environment (pure functions).

#include <algorithm>
#include <map>
#include <thread>

#include "meshtrain/launch/launcher.h"
#include "meshtrain/util/error.h"

namespace meshtrain {
namespace launch {

namespace {

int to_int(const std::string& flag, const std::string& value) {
  try {
    size_t pos = 0;
    const int v = std::stoi(value, &pos);
    if (pos == value.size()) return v;
  } catch (const std::exception&) {
  }
  throw ConfigError(str_cat("meshrun: ", flag, " '", value, "' is not an integer"));
}

}  // namespace

std::string launch_usage() {
  return "usage: meshrun [flags] [--] PROGRAM [ARGS...]\n"
         "Starts ranks of PROGRAM on this node with torchrun's environment variables\n"
         "(RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT).\n"
         "If a rank fails, the others are stopped on every node.\n"
         "  --nproc-per-node N|auto   ranks on this node (auto: one per core; default 1)\n"
         "  --nnodes M                nodes in the job (default 1)\n"
         "  --node-rank R             this node's index, 0 hosts the store (default 0)\n"
         "  --master-addr ADDR        node 0's address (default 127.0.0.1)\n"
         "  --master-port PORT|0      the store's port (default 29500; 0: a free one, one node only)\n"
         "  --rdzv-endpoint HOST[:PORT]  the same two in one flag, as torchrun\n"
         "  --standalone              one node on 127.0.0.1 with a free port, as torchrun\n"
         "  --rdzv-timeout S          how long nodes wait for each other (default 300 s)\n"
         "  --max-restarts K          restart the whole group up to K times after a failure (default 0)\n"
         "  --grace-seconds S         SIGTERM to SIGKILL when stopping ranks (default 5)\n"
         "  --threads-per-rank T      OMP/OpenBLAS threads per rank (default: cores / ranks)\n"
         "  --no-prefix               do not prefix output lines with [rankN]:\n"
         "  --quiet                   no meshrun progress lines (failures are still said)\n"
         "  --version                 print meshrun's version\n";
}

// The parsed flags against each other; ConfigError naming the flag and the fix.
static void check_launch_options(LaunchOptions& o, bool standalone) {
  if (standalone) {
    MESHTRAIN_CHECK(o.nnodes == 1, "meshrun: --standalone is one node; it cannot go with --nnodes ", o.nnodes);
    o.master_addr = "127.0.0.1";
    o.master_port = 0;
  }
  MESHTRAIN_CHECK(!o.command.empty(), "meshrun: no program given; put it after '--'\n", launch_usage());
  MESHTRAIN_CHECK(o.nproc_per_node >= 1, "meshrun: --nproc-per-node ", o.nproc_per_node, " must be at least 1");
  MESHTRAIN_CHECK(o.nnodes >= 1, "meshrun: --nnodes ", o.nnodes, " must be at least 1");
  MESHTRAIN_CHECK(o.node_rank >= 0 && o.node_rank < o.nnodes, "meshrun: --node-rank ", o.node_rank,
                  " must be in [0, --nnodes ", o.nnodes, ")");
  MESHTRAIN_CHECK(o.master_port >= 0 && o.master_port <= 65535, "meshrun: --master-port ", o.master_port,
                  " must be in [0, 65535]");
  MESHTRAIN_CHECK(o.master_port != 0 || o.nnodes == 1, "meshrun: --master-port 0 (pick a free port) "
                  "works on one node only; with --nnodes ", o.nnodes, " every node must be given the same port");
  MESHTRAIN_CHECK(o.max_restarts >= 0, "meshrun: --max-restarts ", o.max_restarts, " must be >= 0");
  MESHTRAIN_CHECK(o.threads_per_rank >= 0, "meshrun: --threads-per-rank ", o.threads_per_rank, " must be >= 0");
}

LaunchOptions parse_launch_args(const std::vector<std::string>& args) {
  LaunchOptions o;
  bool standalone = false;
  size_t i = 0;
  auto value = [&](const std::string& flag, std::string inline_value) {
    if (!inline_value.empty()) return inline_value;
    MESHTRAIN_CHECK(i + 1 < args.size(), "meshrun: ", flag, " needs a value\n", launch_usage());
    return args[++i];
  };
  for (; i < args.size(); ++i) {
    std::string a = args[i];
    if (a == "--") {
      o.command.assign(args.begin() + i + 1, args.end());
      break;
    }
    std::string inline_value;
    const auto eq = a.find('=');
    if (a.rfind("--", 0) == 0 && eq != std::string::npos) {
      inline_value = a.substr(eq + 1);
      a = a.substr(0, eq);
    }
    std::replace(a.begin(), a.end(), '_', '-');  // torchrun spells --nproc_per_node
    if (a == "--nproc-per-node") {
      const std::string v = value(a, inline_value);
      o.nproc_per_node = v == "auto" ? static_cast<int>(std::max(1u, std::thread::hardware_concurrency())) : to_int(a, v);
    }
    else if (a == "--standalone") standalone = true;
    else if (a == "--rdzv-endpoint") {
      const std::string v = value(a, inline_value);
      const auto colon = v.rfind(':');
      o.master_addr = v.substr(0, colon);
      if (colon != std::string::npos) o.master_port = to_int(a, v.substr(colon + 1));
      MESHTRAIN_CHECK(!o.master_addr.empty(), "meshrun: --rdzv-endpoint '", v, "' needs a host (HOST or HOST:PORT)");
    }
    else if (a == "--rdzv-timeout") {
      const int s = to_int(a, value(a, inline_value));
      MESHTRAIN_CHECK(s > 0, "meshrun: --rdzv-timeout ", s, " must be a positive number of seconds");
      o.rendezvous_timeout = std::chrono::seconds(s);
    }
    else if (a == "--quiet") o.quiet = true;
    else if (a == "--nnodes") o.nnodes = to_int(a, value(a, inline_value));
    else if (a == "--node-rank") o.node_rank = to_int(a, value(a, inline_value));
    else if (a == "--master-addr") o.master_addr = value(a, inline_value);
    else if (a == "--master-port") o.master_port = to_int(a, value(a, inline_value));
    else if (a == "--max-restarts") o.max_restarts = to_int(a, value(a, inline_value));
    else if (a == "--grace-seconds") {
      const int s = to_int(a, value(a, inline_value));
      MESHTRAIN_CHECK(s >= 0 && s <= 86400, "meshrun: --grace-seconds ", s, " must be in [0, 86400]");
      o.grace = std::chrono::seconds(s);
    }
    else if (a == "--threads-per-rank") o.threads_per_rank = to_int(a, value(a, inline_value));
    else if (a == "--no-prefix") o.prefix_output = false;
    else if (a == "--help" || a == "-h") throw ConfigError(launch_usage());
    else if (a.rfind("-", 0) != 0) {
      // torchrun style without "--": the first non-flag starts the command.
      o.command.assign(args.begin() + i, args.end());
      break;
    } else {
      throw ConfigError(str_cat("meshrun: unknown flag '", args[i], "'\n", launch_usage()));
    }
  }
  check_launch_options(o, standalone);
  return o;
}

std::map<std::string, std::string> rank_environment(const LaunchOptions& o, int local_rank, int restart,
                                                    int store_port, int cores,
                                                    const std::map<std::string, std::string>& base) {
  std::map<std::string, std::string> env = base;
  const int rank = o.node_rank * o.nproc_per_node + local_rank;
  env["RANK"] = std::to_string(rank);
  env["WORLD_SIZE"] = std::to_string(o.nnodes * o.nproc_per_node);
  env["LOCAL_RANK"] = std::to_string(local_rank);
  env["LOCAL_WORLD_SIZE"] = std::to_string(o.nproc_per_node);
  env["GROUP_RANK"] = std::to_string(o.node_rank);
  env["NODE_RANK"] = std::to_string(o.node_rank);
  env["MASTER_ADDR"] = o.master_addr;
  env["MASTER_PORT"] = std::to_string(store_port);
  env["MESHTRAIN_AGENT_STORE"] = "1";
  env["MESHTRAIN_RESTART_COUNT"] = std::to_string(restart);
  env["TORCHELASTIC_RESTART_COUNT"] = std::to_string(restart);
  // Each rank gets its share of the cores, unless the user chose (torchrun's habit).
  const int threads = o.threads_per_rank > 0 ? o.threads_per_rank : std::max(1, cores / o.nproc_per_node);
  for (const char* var : {"OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"}) {
    if (!base.count(var)) env[var] = std::to_string(threads);
  }
  return env;
}

}  // namespace launch
}  // namespace meshtrain
