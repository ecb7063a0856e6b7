// Collective bandwidth of meshtrain's Communicator (run under meshrun, or
// under mpirun for the MPI backend: its OpenMPI peer is mpi_peer.c).
// Protocol, shared with torch_peer.py so the two are comparable side by side:
// per op and size, one untimed call, 5 warm-up calls, a calibration of the
// iteration count to ~target seconds (agreed with an all_reduce MAX), a
// barrier, the timed block; time per op = max over ranks (the mean, and the
// per-call median, 99th percentile and maximum).
// Sizes follow nccl-tests: S = the tensor (all_reduce, broadcast) or the full
// gathered / scattered buffer (all_gather, reduce_scatter); bus bandwidth =
// S/t * 2(n-1)/n (all_reduce), * (n-1)/n (all_gather, reduce_scatter), * 1 (broadcast).
// all_to_all: S is one rank's whole send buffer, S/n to each rank (MPI_Alltoallv on the peer).
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <iostream>
#include <sstream>

#include "comm/host_profile.h"
#include "meshtrain/comm.h"

using namespace meshtrain;
using Clock = std::chrono::steady_clock;

namespace {

std::vector<int64_t> parse_sizes(const std::string& s) {
  std::vector<int64_t> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    int64_t mult = 1;
    char suffix = item.back();
    if (suffix == 'K') mult = 1024;
    if (suffix == 'M') mult = 1024 * 1024;
    if (mult > 1) item.pop_back();
    out.push_back(std::stoll(item) * mult);
  }
  return out;
}

std::function<void()> make_op(comm::Communicator& c, const std::string& op, int64_t bytes) {
  const int64_t numel = bytes / 4, per = numel / c.size();
  if (op == "all_reduce") {
    auto t = torch::zeros({numel});
    return [&c, t] { c.all_reduce(t); };
  }
  if (op == "all_gather") {
    auto in = torch::zeros({per}), out = torch::empty({per * c.size()});
    return [&c, in, out] { c.all_gather_into(out, in); };
  }
  if (op == "reduce_scatter") {
    auto in = torch::zeros({per * c.size()}), out = torch::empty({per});
    return [&c, in, out] { c.reduce_scatter_into(out, in); };
  }
  if (op == "broadcast") {
    auto t = torch::zeros({numel});
    return [&c, t] { c.broadcast(t, 0); };
  }
  if (op == "all_to_all") {  // S/n to every rank (itself included), through the variable-size interface
    std::vector<at::Tensor> inputs;
    for (int r = 0; r < c.size(); ++r) inputs.push_back(torch::zeros({per}));
    return [&c, inputs] { c.all_to_all(inputs); };
  }
  if (op == "sendrecv") {  // ping-pong between ranks 0 and 1: time per op = half a round trip
    auto out = torch::zeros({numel}), in = torch::empty({numel});
    return [&c, out, in] {
      if (c.rank() == 0) {
        c.send(out, 1);
        c.recv(in, 1);
      } else if (c.rank() == 1) {
        c.recv(in, 0);
        c.send(out, 0);
      }
    };
  }
  throw std::invalid_argument("unknown op " + op);
}

// Time per op: the mean of the timed block, and the block's per-call
// percentiles, which show what a mean hides: a tail of calls that each wait
// for the scheduler (a wake-up on a busy core waits out its time slice).
struct Timing {
  double mean = 0, p50 = 0, p99 = 0, max = 0;
};

Timing time_per_op(comm::Communicator& c, const std::function<void()>& fn, double target_s) {
  fn();
  for (int i = 0; i < 5; ++i) fn();
  c.barrier();
  auto t0 = Clock::now();
  for (int i = 0; i < 3; ++i) fn();
  const double est = std::chrono::duration<double>(Clock::now() - t0).count() / 3;
  auto iters = torch::tensor({static_cast<int64_t>(std::min(5000.0, std::max(5.0, target_s / std::max(est, 1e-9))))});
  c.all_reduce(iters, comm::ReduceOp::kMax);
  const int64_t n = iters.item<int64_t>();
  std::vector<double> each(n);
  c.barrier();
  t0 = Clock::now();
  for (int64_t i = 0; i < n; ++i) {
    const auto start = Clock::now();
    fn();
    each[i] = std::chrono::duration<double>(Clock::now() - start).count();
  }
  const double mean = std::chrono::duration<double>(Clock::now() - t0).count() / n;
  std::sort(each.begin(), each.end());
  auto at = [&](double q) { return each[std::min<int64_t>(n - 1, static_cast<int64_t>(q * n))]; };
  auto t = torch::tensor({mean, at(0.5), at(0.99), each.back()}, torch::kFloat64);
  c.all_reduce(t, comm::ReduceOp::kMax);  // the slowest rank's
  return Timing{t[0].item<double>(), t[1].item<double>(), t[2].item<double>(), t[3].item<double>()};
}

}  // namespace

int main(int argc, char** argv) {
  std::string sizes = "4K,64K,1M,16M,64M", ops = "all_reduce,all_gather,reduce_scatter,broadcast", out;
  double target_s = 0.3;
  bool verify = true;
  int64_t inline_kb = -1;  // CommOptions::inline_bytes in KiB (Gloo's one-round threshold); -1: the default
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string f = argv[i], v = argv[i + 1];
    if (f == "--sizes") sizes = v;
    else if (f == "--ops") ops = v;
    else if (f == "--target-s") target_s = std::stod(v);
    else if (f == "--verify") verify = v == "1";
    else if (f == "--inline-kb") inline_kb = std::stoll(v);
    else if (f == "--out") out = v;
  }
  comm::CommOptions options;
  options.verify = verify;
  if (inline_kb >= 0) options.inline_bytes = inline_kb << 10;
  auto c = comm::init_from_env(options);
  torch::set_num_threads(1);
  // What this host's waits cost and the budgets chosen from it (Note [Self-tuned waits]);
  // the ranks of this benchmark share one host.
  const comm::HostProfile& host = comm::host_profile();
  const comm::WaitTuning waits = comm::choose_wait(host, c->size() <= host.cores);
  const comm::WaitTuning link_waits = comm::choose_link_wait(host, c->size() <= host.cores);
  const comm::LinkBuffer links = comm::choose_link_buffer(host, c->size() - 1);
  const std::string tuning = c->tuning();  // the communicator's own choices (shm: the one-step threshold)
  if (c->rank() == 0) {
    std::cout << "host: " << comm::describe(host) << "\nwaits: " << waits.why << "\nlink waits: " << link_waits.why
              << "\n" << links.why << std::endl;
    if (!tuning.empty()) std::cout << tuning << std::endl;
  }
  std::ostringstream json;
  // The impl names the backend: "meshtrain shm", "meshtrain gloo", "meshtrain mpi" (whose peer is bench_mpi_peer).
  json << "{\"impl\": \"meshtrain " << c->backend() << (verify ? "" : " (verify off)")
       << "\", \"world_size\": " << c->size() << ", \"host\": \"" << comm::describe(host) << "\", \"waits\": \""
       << waits.why << "\", \"link_waits\": \"" << link_waits.why << "\", \"links\": \"" << links.why
       << "\", \"tuning\": \"" << tuning << "\", \"rows\": [";
  bool first = true;
  std::stringstream ops_ss(ops);
  std::string op;
  while (std::getline(ops_ss, op, ',')) {
    for (int64_t bytes : parse_sizes(sizes)) {
      Timing t = time_per_op(*c, make_op(*c, op, bytes), target_s);
      if (op == "sendrecv") t = Timing{t.mean / 2, t.p50 / 2, t.p99 / 2, t.max / 2};
      if (c->rank() == 0) {
        json << (first ? "" : ", ") << "{\"op\": \"" << op << "\", \"bytes\": " << bytes << ", \"sec_per_op\": " << t.mean
             << ", \"p50_s\": " << t.p50 << ", \"p99_s\": " << t.p99 << ", \"max_s\": " << t.max << "}";
        first = false;
        std::cout << op << " " << bytes << " B: " << t.mean * 1e6 << " us (per call: median " << t.p50 * 1e6 << ", p99 "
                  << t.p99 * 1e6 << ", max " << t.max * 1e6 << ")" << std::endl;
      }
    }
  }
  json << "]}\n";
  if (c->rank() == 0 && !out.empty()) std::ofstream(out) << json.str();
  return 0;
}
