// meshrun's argument parsing and per-rank environment (pure functions).

#include <algorithm>
#include <map>
#include <thread>

#include "app/launch/launcher.h"
#include "comm/store.h"
#include "meshtrain/util.h"
#include "util/files.h"
#include "util/flags.h"
#include "util/strings.h"
#include "meshtrain/version.h"

namespace meshtrain {
namespace launch {

namespace {

using flags::Flag;
using flags::store;

// meshrun's flags, setting fields of `o` (and `standalone`).
flags::Parser launch_parser(LaunchOptions& o, bool& standalone) {
  auto nproc = [&o](const std::string& f, const std::string& v) {
    o.nproc_per_node = v == "auto" ? static_cast<int>(std::max(1u, std::thread::hardware_concurrency()))
                                   : flags::to_integer<int>(f, v);
  };
  auto endpoint = [&o](const std::string& f, const std::string& v) {
    const auto colon = v.rfind(':');
    o.master_addr = v.substr(0, colon);
    if (colon != std::string::npos) o.master_port = flags::to_integer<int>(f, v.substr(colon + 1));
    MESHTRAIN_CHECK(!o.master_addr.empty(), f, " '", v, "' needs a host (HOST or HOST:PORT)");
  };
  auto seconds = [](std::chrono::milliseconds& field, int low) {
    return [&field, low](const std::string& f, const std::string& v) {
      const int s = flags::to_integer<int>(f, v);
      MESHTRAIN_CHECK(s >= low && s <= 86400, f, " ", s, " must be in [", low, ", 86400] seconds");
      field = std::chrono::seconds(s);
    };
  };
  auto nnodes = [&o](const std::string& f, const std::string& v) {
    const auto colon = v.find(':');
    o.elastic = colon != std::string::npos;
    o.nnodes = flags::to_integer<int>(f, v.substr(o.elastic ? colon + 1 : 0));
    o.min_nodes = o.elastic ? flags::to_integer<int>(f, v.substr(0, colon)) : o.nnodes;
  };
  std::vector<flags::Group> groups = {
      {"", {Flag{"--nproc-per-node", "N|auto", "ranks on this node (auto: one per core; default 1)", nproc},
            Flag{"--nnodes", "M|MIN:MAX", "nodes in the job (default 1); MIN:MAX: elastic, goes on with at least MIN "
                 "and takes nodes back up to MAX", nnodes},
            store("--node-rank", "R", "this node's index, 0 hosts the store (default 0)", o.node_rank),
            store("--master-addr", "ADDR", "node 0's address (default 127.0.0.1)", o.master_addr),
            store("--master-port", "PORT|0", "the store's port (default 29500; 0: a free one, one node only)",
                  o.master_port),
            Flag{"--rdzv-endpoint", "HOST[:PORT]", "the same two in one flag, as torchrun", endpoint},
            flags::turn("--standalone", "one node on 127.0.0.1 with a free port, as torchrun", standalone),
            store("--rdzv-token-file", "FILE",
                  "the job's secret, the same file on every node (default: MESHTRAIN_RDZV_TOKEN, else one made "
                  "per job on one node)", o.rdzv_token_file),
            Flag{"--rdzv-timeout", "S", "how long nodes wait for each other (default 300 s)",
                 seconds(o.rendezvous_timeout, 1)},
            Flag{"--rdzv-last-call", "S", "elastic: how long node 0 waits for more nodes once MIN are there "
                 "(default 10 s)", seconds(o.last_call, 0)},
            store("--max-restarts", "K", "restart the whole group up to K times after a failure (default 0)",
                  o.max_restarts),
            Flag{"--grace-seconds", "S", "SIGTERM to SIGKILL when stopping ranks (default 5)", seconds(o.grace, 0)},
            store("--threads-per-rank", "T", "OMP/OpenBLAS threads per rank (default: cores / ranks)",
                  o.threads_per_rank),
            flags::turn("--no-prefix", "do not prefix output lines with [rankN]:", o.prefix_output, false),
            flags::turn("--quiet", "no meshrun progress lines (failures are still said)", o.quiet),
            Flag{"--version", "", "print meshrun's version", [](const std::string&, const std::string&) {}}}}};
  flags::Parser parser("meshrun",
                       "usage: meshrun [flags] [--] PROGRAM [ARGS...]\n"
                       "Starts ranks of PROGRAM on this node with torchrun's environment variables\n"
                       "(RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT).\n"
                       "If a rank fails, the others are stopped on every node.\n",
                       std::move(groups));
  parser.rest_is_a_command().underscores_as_dashes();  // torchrun spells --nproc_per_node
  return parser;
}

}  // namespace

std::string launch_usage() {
  LaunchOptions unused;
  bool standalone = false;
  return launch_parser(unused, standalone).usage();
}

bool launch_asks_for_help(const std::vector<std::string>& args) {
  LaunchOptions unused;
  bool standalone = false;
  return launch_parser(unused, standalone).asks_for_help(args);
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
  MESHTRAIN_CHECK(o.min_nodes >= 1 && o.min_nodes <= o.nnodes, "meshrun: --nnodes ", o.min_nodes, ":", o.nnodes,
                  " needs 1 <= MIN <= MAX");
  MESHTRAIN_CHECK(!o.elastic || o.master_port != 0, "meshrun: an elastic job (--nnodes MIN:MAX) needs a "
                  "--master-port every node is given");
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
  o.command = launch_parser(o, standalone).parse(args);
  check_launch_options(o, standalone);
  return o;
}

std::string resolve_rdzv_token(LaunchOptions& o) {
  if (!o.rdzv_token_file.empty()) {
    MESHTRAIN_CHECK(files::exists(o.rdzv_token_file), "meshrun: --rdzv-token-file ", o.rdzv_token_file,
                    " does not exist");
    o.rdzv_token = trim(files::read_all(o.rdzv_token_file));
    MESHTRAIN_CHECK(o.rdzv_token.size() >= 16, "meshrun: --rdzv-token-file ", o.rdzv_token_file, " holds ",
                    o.rdzv_token.size(), " characters; a token needs at least 16 (e.g. openssl rand -hex 32 > ",
                    o.rdzv_token_file, ")");
    o.rdzv_token_origin = "--rdzv-token-file " + o.rdzv_token_file;
    return "";
  }
  o.rdzv_token = comm::rdzv_token_from_env();
  if (!o.rdzv_token.empty()) return "";
  if (o.nnodes == 1) {
    o.rdzv_token = comm::generate_rdzv_token();
    return "";
  }
  return "warning: no rendezvous token (--rdzv-token-file or MESHTRAIN_RDZV_TOKEN): any process that reaches " +
         o.master_addr + ":" + std::to_string(o.master_port) + " can read and write the store";
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
  if (!o.rdzv_token.empty()) env["MESHTRAIN_RDZV_TOKEN"] = o.rdzv_token;  // the environment, never argv
  env["MESHTRAIN_RESTART_COUNT"] = std::to_string(restart);
  env["TORCHELASTIC_RESTART_COUNT"] = std::to_string(restart);
  // Each rank gets its share of the cores, unless the user chose (torchrun's habit).
  const int threads = o.threads_per_rank > 0 ? o.threads_per_rank : std::max(1, cores / o.nproc_per_node);
  for (const char* var : {"OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"}) {
    if (!base.count(var)) env[var] = std::to_string(threads);
  }
  // libtorch's OpenMP threads and Debian's OpenBLAS (its own pthread pool)
  // take turns on the same cores; with OpenMP's default waits its idle
  // threads spin through every matmul. One rank of 2 threads on 2 cores,
  // GPT-2 124M: 2.3-3.1 s/step spinning, 1.4-1.5 passive, 1.6 on 1 thread.
  if (!base.count("OMP_WAIT_POLICY")) env["OMP_WAIT_POLICY"] = "PASSIVE";
  return env;
}

namespace {

// The settings nodes compare (Note [Nodes agree]), and how to make them agree.
struct NodeSetting {
  const char* name;
  const char* fix;
};
const NodeSetting kNodeSettings[] = {
    {"--nnodes", "start every node's meshrun with the same --nnodes (the same MIN:MAX on every node of an elastic job)"},
    {"--nproc-per-node", "start every node's meshrun with the same --nproc-per-node"},
    {"--max-restarts", "start every node's meshrun with the same --max-restarts"},
    {"token", "give every node the same --rdzv-token-file (or MESHTRAIN_RDZV_TOKEN), node 0 too, or none anywhere"},
    {"version", "install the same meshtrain version on every node"},
};

// name -> (value, shown) of node_settings' lines; malformed lines are skipped.
std::map<std::string, std::pair<std::string, std::string>> parse_node_settings(const std::string& text) {
  std::map<std::string, std::pair<std::string, std::string>> out;
  for (const std::string& line : split(text, '\n')) {
    const std::vector<std::string> fields = split(line, '\t');
    if (fields.size() == 3) out[fields[0]] = {fields[1], fields[2]};
  }
  return out;
}

}  // namespace

std::string node_settings(const LaunchOptions& o) {
  const std::string nnodes = o.elastic ? str_cat(o.min_nodes, ":", o.nnodes) : std::to_string(o.nnodes);
  const bool token = !o.rdzv_token.empty();
  return str_cat("--nnodes\t", nnodes, "\t--nnodes ", nnodes, "\n",
                 "--nproc-per-node\t", o.nproc_per_node, "\t--nproc-per-node ", o.nproc_per_node, "\n",
                 "--max-restarts\t", o.max_restarts, "\t--max-restarts ", o.max_restarts, "\n",
                 "token\t", token ? "yes" : "no", "\t",
                 token ? str_cat("a rendezvous token (", o.rdzv_token_origin, ")") : "no rendezvous token", "\n",
                 "version\t", version(), "\tmeshtrain ", version(), "\n");
}

std::string node_settings_difference(const std::string& mine, const std::string& node0, int node) {
  const auto a = parse_node_settings(mine), b = parse_node_settings(node0);
  std::vector<std::string> sentences;
  for (const NodeSetting& s : kNodeSettings) {
    const auto x = a.find(s.name), y = b.find(s.name);
    if (x == a.end() || y == b.end() || x->second.first == y->second.first) continue;
    sentences.push_back(str_cat("node ", node, "'s meshrun has ", x->second.second, " and node 0's has ",
                                y->second.second, ": ", s.fix));
  }
  return join(sentences, "; ");
}

}  // namespace launch
}  // namespace meshtrain
