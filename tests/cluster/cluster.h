#pragma once
// Test hosts for the cluster tests (issue 30): network namespaces made by
// tests/cluster/hosts.sh, and meshrun nodes started on them.

#include <stdlib.h>
#include <unistd.h>

#include <cstdint>
#include <fstream>
#include <sstream>
#include <string>

#include "../dist/shell.h"
#include "meshtrain/util.h"

namespace meshtrain {
namespace testing {

// What the kernel counted on one host's link (its veth), both directions.
struct LinkCounters {
  int64_t tx_bytes = 0, rx_bytes = 0, tx_packets = 0, rx_packets = 0;
  LinkCounters operator-(const LinkCounters& o) const {
    return {tx_bytes - o.tx_bytes, rx_bytes - o.rx_bytes, tx_packets - o.tx_packets, rx_packets - o.rx_packets};
  }
  int64_t bytes() const { return tx_bytes + rx_bytes; }
  int64_t packets() const { return tx_packets + rx_packets; }
};

inline const std::string kHosts = kSource + "/tests/cluster/hosts.sh";
inline const std::string kTiny =
    " --model gpt --layers 4 --hidden 32 --heads 4 --vocab 64 --seq-len 16 --global-batch 24 --lr 1e-2"
    " --adam-eps 1e-6 --eval-problems 0 ";

// What all ranks sent to other hosts per step, from `meshtrain --metrics-out`:
// the payload ("inter_host") and the verification rounds, a row apart.
inline double inter_host_bytes_sent(const json::Value& metrics) {
  double sum = 0;
  for (size_t i = 0; i < metrics["ranks"].size(); ++i) {
    const json::Value& traffic = metrics["ranks"][i]["traffic"];
    sum += traffic["inter_host"]["bytes_sent"].num();
    if (traffic.has("verify") && traffic["verify"].has("inter_host_sent")) sum += traffic["verify"]["inter_host_sent"].num();
  }
  return sum;
}

// N test hosts for one test, removed with everything in them when it ends.
class Hosts {
 public:
  explicit Hosts(int n) : n_(n) {
    const int id = static_cast<int>(::getpid() % 100000);
    name_ = str_cat("mt", id);
    subnet_ = str_cat("10.", 100 + id % 100, ".", id / 100 % 250);
    Shell r = sh(str_cat(kHosts, " up ", name_, " ", n, " ", subnet_));
    ok_ = r.exit_code == 0;
    why_ = r.output;
  }
  ~Hosts() { sh(str_cat(kHosts, " down ", name_, " ", n_)); }
  bool ok() const { return ok_; }
  const std::string& why() const { return why_; }
  std::string address(int i) const { return str_cat(subnet_, ".", i + 1); }
  // The hosts' network, as OpenMPI's *_if_include take it.
  std::string network() const { return subnet_ + ".0/24"; }
  // The shell words that run the rest of a command on host i.
  std::string on(int i) const { return str_cat(kHosts, " run ", name_, " ", i, " "); }
  // hosts.sh's cut, cut-in (one way) on host i's link.
  std::string action(const std::string& what, int i) const { return str_cat(kHosts, " ", what, " ", name_, " ", i); }
  const std::string& name() const { return name_; }
  // Processes still running inside host i's network namespace.
  std::string processes(int i) const { return sh(str_cat("ip netns pids ", name_, i)).output; }
  // What host i's processes left in its /dev/shm (hosts.sh keeps it as the machine's /dev/shm/testhost-NAME<i>).
  std::string shm_left(int i) const { return sh(str_cat("ls -A /dev/shm/testhost-", name_, i, " 2>/dev/null")).output; }
  // The kernel's counters of host i's link (bytes include each frame's Ethernet, IP and TCP headers).
  LinkCounters link_counters(int i) const {
    std::istringstream in(sh(str_cat("ip netns exec ", name_, i, " sh -c 'cd /sys/class/net/", name_, "h", i,
                                     "/statistics && cat tx_bytes rx_bytes tx_packets rx_packets'"))
                              .output);
    LinkCounters c;
    in >> c.tx_bytes >> c.rx_bytes >> c.tx_packets >> c.rx_packets;
    MESHTRAIN_CHECK(!in.fail(), "cannot read the counters of host ", i, "'s link ", name_, "h", i);
    return c;
  }

 private:
  int n_;
  std::string name_, subnet_, why_;
  bool ok_ = false;
};

// An environment variable set for one test (the shells it starts inherit it).
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) { ::setenv(name, value, 1); }
  ~ScopedEnv() { ::unsetenv(name_); }

 private:
  const char* name_;
};

// The job's rendezvous token file in `t`.
inline std::string token_file(const TempDir& t) {
  std::ofstream(t.file("token")) << "0123456789abcdef0123456789abcdef\n";
  return t.file("token");
}

// meshrun on node `node` of `nodes` (host `node`), `per_node` ranks each, store on host 0.
inline std::string node_command(const Hosts& h, int node, const std::string& token, const std::string& flags, int nodes = 2,
                         int per_node = 2) {
  return str_cat(h.on(node), kBin, "/meshrun --nnodes ", nodes, " --node-rank ", node, " --nproc-per-node ", per_node,
                 " --master-addr ", h.address(0), " --master-port 29611 --rdzv-token-file ", token,
                 " --grace-seconds 1 -- ", kBin, "/meshtrain", flags);
}

// mpirun on host 0 starting `per_host` ranks of `program` on each host: its
// daemons on the others come up through mpi_agent.sh (ssh's place); OpenMPI's
// TCP between the hosts (their own network only), its shared memory inside;
// its ranks yield while they wait (4 busy-polling ranks on 2 cores crawl).
// Writes the hostfile into `t`.
inline std::string mpirun_command(const Hosts& h, const TempDir& t, int hosts, int per_host,
                                  const std::string& program) {
  std::ofstream hostfile(t.file("hostfile"));
  for (int i = 0; i < hosts; ++i) hostfile << h.address(i) << " slots=" << per_host << "\n";
  hostfile.close();
  return str_cat(h.on(0), "mpirun --allow-run-as-root --hostfile ", t.file("hostfile"), " -np ", hosts * per_host,
                 " --mca plm_rsh_agent ", kSource, "/tests/cluster/mpi_agent.sh --mca btl tcp,vader,self",
                 " --mca btl_tcp_if_include ", h.network(), " --mca oob_tcp_if_include ", h.network(),
                 " --mca mpi_yield_when_idle 1 --bind-to none --display-map ", program);
}

// Runs the job on every host (node i on host i) and returns node 0's output
// followed by the others' logs; "node 0 exit N" says how node 0 ended.
inline Shell run_job(const Hosts& h, const TempDir& t, const std::string& flags, int nodes, int per_node) {
  const std::string token = token_file(t);
  std::string cmd = "(", logs;
  for (int node = 1; node < nodes; ++node) {
    const std::string log = t.file(str_cat("n", node, ".log"));
    cmd += str_cat(node_command(h, node, token, flags, nodes, per_node), " > ", log, " 2>&1 & ");
    logs += " " + log;
  }
  cmd += str_cat(node_command(h, 0, token, flags, nodes, per_node), "; echo node 0 exit $?; wait); cat", logs);
  return sh(cmd);
}

}  // namespace testing
}  // namespace meshtrain
