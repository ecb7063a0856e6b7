// The end-of-run report of a training run (see run_parts.h).
#include <ATen/ATen.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>

#include "meshtrain/dp.h"
#include "meshtrain/models.h"
#include "pp/trace.h"
#include "app/trainer/evaluate.h"
#include "meshtrain/train.h"
#include "meshtrain/util.h"
#include "util/sha256.h"
#include "run_parts.h"

namespace meshtrain {
namespace train {

namespace {

double mean_after_first(const std::vector<double>& xs) {
  if (xs.size() < 2) return xs.empty() ? 0.0 : xs[0];
  double sum = 0;
  for (size_t i = 1; i < xs.size(); ++i) sum += xs[i];
  return sum / (xs.size() - 1);
}

double accuracy_of(const TrainConfig& c, const std::map<std::string, at::Tensor>& full) {
  models::Stage dense = [&] {
    const SkipRandomInit overwritten;  // every parameter is copied in below (or the check fails)
    return models::build_stage(c.model, 0, models::num_pieces(c.model));
  }();
  at::NoGradGuard no_grad;
  for (auto& p : dp::unique_parameters(*dense)) {
    auto it = full.find(p.name);
    MESHTRAIN_CHECK(it != full.end(), "evaluation: parameter ", p.name, " missing from the consolidated state");
    p.tensor.copy_(it->second);
  }
  return evaluate_accuracy(c, *dense, c.eval_problems);
}

// One line per event: "rank stage microbatch forward start end".
std::string trace_lines(const std::vector<pp::TraceEvent>& events, int rank) {
  std::string out;
  for (const auto& e : events) {
    out += str_cat(rank, " ", e.stage, " ", e.microbatch, " ", e.forward ? 1 : 0, " ", e.start, " ", e.end, "\n");
  }
  return out;
}

// One pipeline's events (the ranks of dp 0, tp 0), renumbered by pipeline rank.
std::vector<pp::TraceEvent> first_pipeline(const TrainConfig& c, const std::vector<std::string>& lines) {
  std::vector<pp::TraceEvent> events;
  for (int r = 0; r < static_cast<int>(lines.size()); ++r) {
    const int inner = c.tp * c.cp;  // the ranks of one pipeline: dp 0, cp 0, tp 0
    if (r % inner != 0 || r >= c.pp * inner) continue;
    std::istringstream in(lines[r]);
    pp::TraceEvent e{};
    int rank = 0, fwd = 0;
    while (in >> rank >> e.stage >> e.microbatch >> fwd >> e.start >> e.end) {
      e.rank = r / inner;
      e.forward = fwd != 0;
      events.push_back(e);
    }
  }
  return events;
}

// What the training communicators moved and what the state holds, taken
// before consolidation adds its own traffic.
struct TrainingFigures {
  comm::Traffic traffic;
  std::map<std::string, comm::Traffic> traffic_by_axis;
  StateBytes state;
};

TrainingFigures figures_of(const Engine& engine) {
  return {engine.traffic(), engine.traffic_by_axis(), engine.state_bytes()};
}

// This rank's memory and traffic, per step of this run (after --resume, only the steps it ran).
std::string rank_json(const TrainingFigures& f, int rank, int64_t steps_run) {
  json::Object by_axis;
  for (const auto& kv : f.traffic_by_axis) by_axis.raw(kv.first, traffic_json(kv.second, steps_run));
  return json::Object()
      .integer("rank", rank)
      .integer("peak_rss_bytes", peak_rss_bytes())
      .raw("state_bytes", state_bytes_json(f.state))
      .raw("traffic", traffic_json(f.traffic, steps_run))
      .raw("traffic_by_axis", by_axis.str())
      .str();
}

// --experts: each step's routes per layer and expert, their imbalance and drops.
std::string experts_json(const TrainResult& result) {
  std::vector<std::string> loads;
  std::vector<double> imbalance, dropped;
  for (const at::Tensor& load : result.router_load) {
    loads.push_back(router_load_json(load));
    imbalance.push_back(router_imbalance(load));
    dropped.push_back(static_cast<double>(routes_dropped(load)));
  }
  return json::Object()
      .raw("router_load", json::array(loads))
      .raw("router_imbalance", json::numbers(imbalance))
      .raw("moe_dropped", json::numbers(dropped))
      .str();
}

std::string run_json(const TrainConfig& c, const TrainResult& result, int world_size, const std::string& checkpoint_json,
                     const std::string& pipeline_json, const std::vector<std::string>& ranks) {
  const double step_time = mean_after_first(result.step_times);
  const double samples = c.global_batch / step_time;
  return json::Object()
      .raw("config", to_json(c))
      .integer("world_size", world_size)
      .raw("losses", json::numbers(result.losses))
      .raw("grad_norms", json::numbers(result.grad_norms))
      .raw("learning_rates", json::numbers(result.learning_rates))
      .raw("mfu", json::numbers(result.mfu))
      .num("model_flops_per_step", result.model_flops_per_step)
      .num("peak_flops", result.peak.flops)
      .str("peak_source", result.peak.how)
      .raw("matmul_flops", json::Object().num("fp32", result.peak.fp32_flops).num("bf16", result.peak.bf16_flops).str())
      .raw("eval_steps", json::numbers(std::vector<double>(result.eval_steps.begin(), result.eval_steps.end())))
      .raw("eval_losses", json::numbers(result.eval_losses))
      .raw("step_times_s", json::numbers(result.step_times))
      .num("step_time_s", step_time)
      .num("samples_per_s", samples)
      .num("tokens_per_s", models::is_language_model(c.model) ? samples * c.model.seq_len : 0.0)
      .num("accuracy", result.accuracy)
      .raw("pipeline", pipeline_json.empty() ? "null" : pipeline_json)
      .raw("experts", result.router_load.empty() ? "null" : experts_json(result))
      .integer("first_step", result.first_step)
      .raw("checkpoint", checkpoint_json)
      .str("weights_sha256", result.weights_sha256)
      .raw("ranks", json::array(ranks))
      .str();
}

void print_summary(const TrainConfig& c, const TrainResult& result) {
  std::printf("\nloss per step (global batch):\n%s", ascii_plot(result.losses).c_str());
  if (!std::isnan(result.accuracy)) {
    std::printf("task accuracy: %.1f%% (%s)\n", 100 * result.accuracy,
                models::is_language_model(c.model) ? "exact answers to held-out a+b= problems" : "held-out classification");
  }
  std::printf("weights sha256: %s\n", result.weights_sha256.c_str());
  if (!c.plot.empty()) {
    write_svg_plot(c.plot, result.losses, "meshtrain: loss per step");
    std::printf("loss curve written to %s\n", c.plot.c_str());
  }
  std::fflush(stdout);
}

}  // namespace

std::string weights_sha256(const std::map<std::string, at::Tensor>& parameters) {
  Sha256 hash;
  for (const auto& kv : parameters) {  // std::map: name order
    const at::Tensor t = kv.second.detach().to(at::kFloat).contiguous();
    hash.update(t.data_ptr(), t.nbytes());
  }
  return hash.hex_digest();
}

std::string pipeline_report(const TrainConfig& c, const Engine& engine, const comm::Communicator& world,
                            comm::Communicator& metrics, bool verbose) {
  if (c.pp == 1 && c.virtual_stages == 1) return "";
  const std::vector<std::string> lines = comm::all_gather_strings(metrics, trace_lines(engine.last_trace(), world.rank()));
  at::Tensor in_flight = at::tensor({static_cast<int64_t>(engine.max_activations_in_flight())});
  metrics.all_reduce(in_flight, comm::ReduceOp::kMax);
  if (world.rank() != 0) return "";
  const std::vector<pp::TraceEvent> events = first_pipeline(c, lines);
  const pp::BubbleStats b = pp::bubble_of(events, c.pp);
  const pp::ScheduleSpec spec{c.schedule, c.pp, c.microbatches, c.virtual_stages};
  if (!c.trace.empty()) {
    const std::string svg = pp::write_trace_files(
        c.trace, events, c.pp,
        str_cat(c.schedule, ", pp ", c.pp, ", ", c.microbatches, " micro-batches",
                c.virtual_stages > 1 ? str_cat(", V ", c.virtual_stages) : ""));
    if (verbose) std::printf("pipeline timeline of the last step: %s (Chrome trace), %s\n", c.trace.c_str(), svg.c_str());
  }
  return json::Object()
      .num("bubble_measured", b.bubble)
      .num("bubble_ideal", pp::ideal_bubble(spec))
      .num("last_step_span_s", b.span)
      .integer("max_activations_in_flight", in_flight.item<int64_t>())
      .str();
}

void finish_run(const TrainConfig& c, Engine& engine, const comm::Communicator& world, comm::Communicator& metrics,
                const RunOptions& options, const std::string& checkpoint_json, const std::string& pipeline_json,
                TrainResult& result) {
  const TrainingFigures figures = figures_of(engine);
  result.full_parameters = engine.full_parameters();
  const bool chief = world.rank() == 0;
  const int64_t steps_run = std::max<int64_t>(1, c.steps - result.first_step);
  const std::vector<std::string> ranks = comm::all_gather_strings(metrics, rank_json(figures, world.rank(), steps_run));
  if (!chief) return;
  // Rank 0 evaluates after the last collective: the others have finished and
  // do not wait for it under the communication timeout.
  if (options.evaluate && c.eval_problems > 0) result.accuracy = accuracy_of(c, result.full_parameters);
  result.weights_sha256 = weights_sha256(result.full_parameters);
  result.metrics_json = run_json(c, result, world.size(), checkpoint_json, pipeline_json, ranks);
  if (!c.metrics_out.empty()) {
    std::ofstream out(c.metrics_out);
    MESHTRAIN_CHECK(out.good(), "--metrics-out ", c.metrics_out, ": cannot write the file");
    out << result.metrics_json << "\n";
  }
  if (options.verbose) print_summary(c, result);
}

}  // namespace train
}  // namespace meshtrain
