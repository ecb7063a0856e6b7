// The pipeline schedules on a synthetic workload (run under meshrun): each
// stage's forward sleeps F ms and its backward 2F ms (divided by V for virtual
// stages), so the measured bubble reflects the schedule and the executor, not
// the two cores the ranks share. Writes the last step's timeline (Chrome trace
// + SVG) and one JSON line: measured and ideal bubble, step time.
//   meshrun --nproc-per-node 4 -- bench_pipeline --schedule 1f1b --microbatches 8 --out r.json
#include <torch/torch.h>

#include <chrono>
#include <fstream>
#include <iostream>
#include <thread>

#include "meshtrain/comm.h"
#include "meshtrain/pp.h"
#include "pp/trace.h"

using namespace meshtrain;

namespace {

struct Sleep : public torch::autograd::Function<Sleep> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, at::Tensor x, double ms) {
    ctx->saved_data["ms"] = ms;
    std::this_thread::sleep_for(std::chrono::microseconds(static_cast<int64_t>(ms * 1000)));
    return x.clone();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list g) {
    std::this_thread::sleep_for(std::chrono::microseconds(static_cast<int64_t>(2 * ctx->saved_data["ms"].toDouble() * 1000)));
    return {g[0], at::Tensor()};
  }
};

}  // namespace

int main(int argc, char** argv) {
  std::string schedule = "1f1b", out, trace;
  int m = 8, v = 1, steps = 3;
  double f_ms = 20;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], val = argv[i + 1];
    if (k == "--schedule") schedule = val;
    else if (k == "--microbatches") m = std::stoi(val);
    else if (k == "--virtual-stages") v = std::stoi(val);
    else if (k == "--forward-ms") f_ms = std::stod(val);
    else if (k == "--steps") steps = std::stoi(val);
    else if (k == "--out") out = val;
    else if (k == "--trace") trace = val;
  }
  auto world = comm::init_from_env();
  const int p = world->size();
  pp::ScheduleSpec spec{schedule, p, m, v};
  auto weight = torch::ones({1}, torch::requires_grad());
  std::vector<pp::StageFn> stages;
  for (int c = 0; c < v; ++c) {
    stages.push_back({c * p + world->rank(), [&](const at::Tensor& x, int) { return Sleep::apply(x * weight, f_ms / v); }});
  }
  pp::PipelineExecutor exec(world, spec, stages);
  std::vector<at::Tensor> inputs(m, torch::ones({4})), targets(m, torch::zeros({4}));
  pp::StepResult r;
  for (int s = 0; s < steps; ++s) {
    world->barrier();
    r = exec.run(inputs, targets, [](const at::Tensor& y, const at::Tensor& t, int) { return (y - t).sum(); });
  }
  // Every rank's events on rank 0.
  std::string mine;
  for (const auto& e : r.events) mine += std::to_string(e.stage) + " " + std::to_string(e.microbatch) + " " + std::to_string(e.forward) + " " + std::to_string(e.start) + " " + std::to_string(e.end) + "\n";
  at::Tensor bytes = at::empty({static_cast<int64_t>(mine.size())}, at::kByte);
  std::memcpy(bytes.data_ptr(), mine.data(), mine.size());
  auto all = world->gather(bytes, 0);
  if (world->rank() != 0) return 0;
  std::vector<pp::TraceEvent> events;
  for (int rank = 0; rank < p; ++rank) {
    std::istringstream in(std::string(static_cast<const char*>(all[rank].data_ptr()), all[rank].numel()));
    pp::TraceEvent e{};
    int fwd;
    while (in >> e.stage >> e.microbatch >> fwd >> e.start >> e.end) {
      e.rank = rank;
      e.forward = fwd;
      events.push_back(e);
    }
  }
  const pp::BubbleStats b = pp::bubble_of(events, p);
  const double ideal_span = (m + p - 1) * 3 * f_ms / 1000.0;
  char line[512];
  std::snprintf(line, sizeof line,
                "{\"schedule\": \"%s\", \"pp\": %d, \"microbatches\": %d, \"virtual_stages\": %d, \"bubble_measured\": %.4f, "
                "\"bubble_ideal\": %.4f, \"step_s\": %.4f, \"ideal_1f1b_step_s\": %.4f, \"max_in_flight_rank0\": %d}",
                schedule.c_str(), p, m, v, b.bubble, pp::ideal_bubble(spec), b.span, ideal_span, r.max_in_flight);
  std::cout << line << std::endl;
  if (!out.empty()) std::ofstream(out) << line << "\n";
  if (!trace.empty()) {
    pp::write_trace_files(trace, events, p, schedule + ", pp " + std::to_string(p) + ", " + std::to_string(m) +
                                              " micro-batches" + (v > 1 ? ", V " + std::to_string(v) : "") + " (synthetic: F " +
                                              std::to_string(static_cast<int>(f_ms)) + " ms, B 2F)");
  }
  return 0;
}
