#include "meshtrain/train/trainer.h"

#include <ATen/ATen.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <signal.h>
#include <thread>
#include <unistd.h>
#include <sstream>

#include "engine.h"
#include "meshtrain/dp/params.h"
#include "meshtrain/models/models.h"
#include "meshtrain/pp/trace.h"
#include "meshtrain/train/checkpoint.h"
#include "meshtrain/train/evaluate.h"
#include "meshtrain/train/metrics.h"
#include "meshtrain/util/error.h"
#include "meshtrain/util/json.h"

namespace meshtrain {
namespace train {

namespace {

using Clock = std::chrono::steady_clock;

int64_t current_rss_bytes() {
  std::ifstream statm("/proc/self/statm");
  int64_t pages = 0, resident = 0;
  statm >> pages >> resident;
  return resident * 4096;
}

void print_progress(const TrainConfig& c, int64_t step, double loss, double grad_norm, double seconds) {
  const double samples = c.global_batch / seconds;
  const double tokens = c.model.kind == "gpt" ? samples * c.model.seq_len : 0.0;
  std::printf("step %4lld/%d | loss %8.4f | grad norm %8.4f%s | %9.1f samples/s | %10.0f tokens/s | %7.3f s/step | "
              "rss %5.0f MiB\n",
              static_cast<long long>(step + 1), c.steps, loss, grad_norm,
              c.clip_grad_norm > 0 && grad_norm > c.clip_grad_norm ? " (clipped)" : "", samples, tokens, seconds,
              current_rss_bytes() / 1048576.0);
  std::fflush(stdout);
}

// Strings from every rank, in rank order (sizes may differ).
std::vector<std::string> gather_strings(comm::Communicator& comm, const std::string& mine) {
  at::Tensor bytes = at::empty({static_cast<int64_t>(mine.size())}, at::kByte);
  std::memcpy(bytes.data_ptr(), mine.data(), mine.size());
  std::vector<std::string> out;
  for (const auto& t : comm.all_gather(bytes)) out.emplace_back(static_cast<const char*>(t.data_ptr()), t.numel());
  return out;
}

// Test hook: MESHTRAIN_TEST_KILL_AT_STEP=k on rank MESHTRAIN_TEST_KILL_RANK (default 1),
// first attempt only (MESHTRAIN_RESTART_COUNT unset or 0): SIGKILL shortly
// after step k starts, i.e. in the middle of the step.
void arm_test_kill(int64_t step) {
  const char* at = std::getenv("MESHTRAIN_TEST_KILL_AT_STEP");
  const char* restart = std::getenv("MESHTRAIN_RESTART_COUNT");
  if (!at || std::atoll(at) != step || (restart && std::atoi(restart) != 0)) return;
  const char* who = std::getenv("MESHTRAIN_TEST_KILL_RANK");
  const char* rank = std::getenv("RANK");
  if ((who ? std::atoi(who) : 1) != (rank ? std::atoi(rank) : 0)) return;
  std::thread([] {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    std::fprintf(stderr, "test hook: killing this rank (SIGKILL) in the middle of a step\n");
    std::fflush(stderr);
    kill(getpid(), SIGKILL);
  }).detach();
}

// Each rank takes back the generator state it saved. Under another world size
// rank r is not the saver's rank r: the generators keep their seeded state
// (meshtrain's models draw no random numbers while training: the data order is
// a function of seed and step, and they have no dropout).
void restore_rng_state(CheckpointReader& reader, const comm::Communicator& world, bool verbose) {
  if (reader.world_size() != world.size()) {
    if (verbose) {
      std::printf("checkpoint saved on %d ranks, resumed on %d: random generators keep their seeded state\n",
                  reader.world_size(), world.size());
    }
    return;
  }
  const at::Tensor state = reader.rng_state(world.rank());
  if (state.defined()) set_cpu_rng_state(state);
}

// After a restart, meshrun passes the wall-clock time it detected the failure.
void report_restart_time() {
  const char* failed = std::getenv("MESHTRAIN_FAILURE_TIME_NS");
  if (!failed) return;
  const auto now = std::chrono::duration_cast<std::chrono::nanoseconds>(
                       std::chrono::system_clock::now().time_since_epoch()).count();
  std::printf("first step after the restart done %.2f s after the failure was detected\n",
              (now - std::atoll(failed)) / 1e9);
}

double mean_after_first(const std::vector<double>& xs) {
  if (xs.size() < 2) return xs.empty() ? 0.0 : xs[0];
  double sum = 0;
  for (size_t i = 1; i < xs.size(); ++i) sum += xs[i];
  return sum / (xs.size() - 1);
}

double accuracy_of(const TrainConfig& c, const std::map<std::string, at::Tensor>& full) {
  models::Stage dense = models::build_stage(c.model, 0, models::num_pieces(c.model));
  at::NoGradGuard no_grad;
  for (auto& p : dp::unique_parameters(*dense)) {
    auto it = full.find(p.name);
    MESHTRAIN_CHECK(it != full.end(), "evaluation: parameter ", p.name, " missing from the consolidated state");
    p.tensor.copy_(it->second);
  }
  return evaluate_accuracy(c, *dense, c.eval_problems);
}

}  // namespace

TrainResult run_training(const TrainConfig& c, comm::CommPtr world, const RunOptions& options) {
  // Logging and reporting use their own communicator, so the training
  // communicators' traffic is the training's alone.
  comm::CommPtr metrics = world->split(0, world->rank(), "metrics");
  const bool chief = world->rank() == 0;
  std::unique_ptr<Engine> engine = make_engine(c, world);
  engine->reset_traffic();  // count steps, not set-up

  TrainResult result;
  // Resume from the latest complete checkpoint, under this run's layout.
  int64_t first_step = 0;
  double load_seconds = 0;
  if (c.resume) {
    MESHTRAIN_CHECK(!c.save_dir.empty(), "--resume needs --save-dir (where the checkpoints are)");
    const std::string step_dir = latest_checkpoint(c.save_dir);
    if (!step_dir.empty()) {
      const auto t0 = Clock::now();
      CheckpointReader reader(step_dir);
      engine->load_checkpoint(reader);
      restore_rng_state(reader, *world, chief && options.verbose);
      first_step = reader.step();
      load_seconds = std::chrono::duration<double>(Clock::now() - t0).count();
      if (chief && options.verbose) {
        std::printf("resumed from checkpoint step %lld (%s), loaded in %.3f s\n", static_cast<long long>(first_step),
                    step_dir.c_str(), load_seconds);
      }
    } else if (chief && options.verbose) {
      std::printf("no checkpoint in %s yet: starting from step 0\n", c.save_dir.c_str());
    }
    MESHTRAIN_CHECK(first_step <= c.steps, "the checkpoint is at step ", first_step, ", past --steps ", c.steps);
  }
  engine->reset_traffic();  // count steps, not set-up and loading
  result.first_step = first_step;
  double save_seconds = 0;
  int64_t save_bytes = 0, saves = 0;
  for (int64_t step = first_step; step < c.steps; ++step) {
    arm_test_kill(step);
    engine->set_learning_rate(learning_rate(c, step));
    const auto t0 = Clock::now();
    at::Tensor loss = at::tensor({engine->step(step)}, at::kDouble);
    const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    metrics->all_reduce(loss);  // the sum of the ranks' contributions is the global-batch loss
    result.losses.push_back(loss.item<double>());
    result.step_times.push_back(seconds);
    result.grad_norms.push_back(engine->last_grad_norm());
    MESHTRAIN_CHECK(std::isfinite(result.grad_norms.back()), "step ", step + 1, ": the gradient norm is ",
                    result.grad_norms.back(), " (a gradient is not finite); lower --lr or clip with --clip-grad-norm");
    if (chief && options.verbose && step == first_step && first_step > 0) report_restart_time();
    if (chief && options.verbose && ((step + 1) % c.log_every == 0 || step + 1 == c.steps)) {
      print_progress(c, step, result.losses.back(), result.grad_norms.back(), seconds);
    }
    if (!c.save_dir.empty() && c.save_every > 0 && (step + 1) % c.save_every == 0) {
      RankState state = engine->checkpoint_state();
      state.rng_state = cpu_rng_state();
      const SaveStats s = save_checkpoint(c.save_dir, step + 1, state, *metrics, to_json(c));
      save_seconds += s.seconds;
      save_bytes += s.bytes;
      ++saves;
      if (chief && options.verbose) {
        std::printf("checkpoint step %lld saved in %.3f s\n", static_cast<long long>(step + 1), s.seconds);
      }
    }
  }
  at::Tensor all_bytes = at::tensor({save_bytes}, at::kLong);
  metrics->all_reduce(all_bytes);
  const std::string checkpoint_json = json::Object()
                                          .integer("resumed_from_step", first_step)
                                          .num("load_seconds", load_seconds)
                                          .integer("saves", saves)
                                          .num("save_seconds", save_seconds)
                                          .integer("save_bytes_all_ranks", all_bytes.item<int64_t>())
                                          .num("save_mb_per_s", save_seconds > 0 ? all_bytes.item<int64_t>() / 1e6 / save_seconds : 0.0)
                                          .str();

  // The last step's pipeline timeline, every rank's events on rank 0.
  std::string pipeline_json;
  if (c.pp > 1 || c.virtual_stages > 1) {
    std::string mine_events;
    for (const auto& e : engine->last_trace()) {
      mine_events += str_cat(world->rank(), " ", e.stage, " ", e.microbatch, " ", e.forward ? 1 : 0, " ", e.start, " ",
                             e.end, "\n");
    }
    const std::vector<std::string> all = gather_strings(*metrics, mine_events);
    at::Tensor in_flight = at::tensor({static_cast<int64_t>(engine->max_activations_in_flight())});
    metrics->all_reduce(in_flight, comm::ReduceOp::kMax);
    if (chief) {
      // Keep one pipeline (the ranks of dp 0, tp 0), renumbered by pipeline rank.
      std::vector<pp::TraceEvent> events;
      for (int r = 0; r < world->size(); ++r) {
        if (r % c.tp != 0 || r >= c.pp * c.tp) continue;
        std::istringstream in(all[r]);
        pp::TraceEvent e{};
        int rank = 0, fwd = 0;
        while (in >> rank >> e.stage >> e.microbatch >> fwd >> e.start >> e.end) {
          e.rank = r / c.tp;
          e.forward = fwd != 0;
          events.push_back(e);
        }
      }
      const pp::BubbleStats b = pp::bubble_of(events, c.pp);
      const pp::ScheduleSpec spec{c.schedule, c.pp, c.microbatches, c.virtual_stages};
      pipeline_json = json::Object()
                          .num("bubble_measured", b.bubble)
                          .num("bubble_ideal", pp::ideal_bubble(spec))
                          .num("last_step_span_s", b.span)
                          .integer("max_activations_in_flight", in_flight.item<int64_t>())
                          .str();
      if (!c.trace.empty()) {
        const std::string svg = pp::write_trace_files(
            c.trace, events, c.pp,
            str_cat(c.schedule, ", pp ", c.pp, ", ", c.microbatches, " micro-batches", c.virtual_stages > 1 ? str_cat(", V ", c.virtual_stages) : ""));
        if (options.verbose) std::printf("pipeline timeline of the last step: %s (Chrome trace), %s\n", c.trace.c_str(), svg.c_str());
      }
    }
  }

  // Snapshot the training traffic before consolidation adds its own.
  const comm::Traffic traffic = engine->traffic();
  const std::map<std::string, comm::Traffic> traffic_by_axis = engine->traffic_by_axis();
  const StateBytes state = engine->state_bytes();
  result.full_parameters = engine->full_parameters();
  if (chief && options.evaluate && c.eval_problems > 0) result.accuracy = accuracy_of(c, result.full_parameters);

  // Per step of this run: after --resume, only the steps it ran.
  const int64_t steps_run = std::max<int64_t>(1, c.steps - first_step);
  json::Object by_axis;
  for (const auto& kv : traffic_by_axis) by_axis.raw(kv.first, traffic_json(kv.second, steps_run));
  const std::string mine = json::Object()
                               .integer("rank", world->rank())
                               .integer("peak_rss_bytes", peak_rss_bytes())
                               .raw("state_bytes", state_bytes_json(state))
                               .raw("traffic", traffic_json(traffic, steps_run))
                               .raw("traffic_by_axis", by_axis.str())
                               .str();
  const std::vector<std::string> ranks = gather_strings(*metrics, mine);
  if (chief) {
    const double step_time = mean_after_first(result.step_times);
    const double samples = c.global_batch / step_time;
    result.metrics_json = json::Object()
                              .raw("config", to_json(c))
                              .integer("world_size", world->size())
                              .raw("losses", json::numbers(result.losses))
                              .raw("grad_norms", json::numbers(result.grad_norms))
                              .raw("step_times_s", json::numbers(result.step_times))
                              .num("step_time_s", step_time)
                              .num("samples_per_s", samples)
                              .num("tokens_per_s", c.model.kind == "gpt" ? samples * c.model.seq_len : 0.0)
                              .num("accuracy", result.accuracy)
                              .raw("pipeline", pipeline_json.empty() ? "null" : pipeline_json)
                              .integer("first_step", first_step)
                              .raw("checkpoint", checkpoint_json)
                              .raw("ranks", json::array(ranks))
                              .str();
    if (!c.metrics_out.empty()) {
      std::ofstream out(c.metrics_out);
      MESHTRAIN_CHECK(out.good(), "--metrics-out ", c.metrics_out, ": cannot write the file");
      out << result.metrics_json << "\n";
    }
    if (options.verbose) {
      std::printf("\nloss per step (global batch):\n%s", ascii_plot(result.losses).c_str());
      if (!std::isnan(result.accuracy)) {
        std::printf("task accuracy: %.1f%% (%s)\n", 100 * result.accuracy,
                    c.model.kind == "gpt" ? "exact answers to held-out a+b= problems" : "held-out classification");
      }
      if (!c.plot.empty()) {
        write_svg_plot(c.plot, result.losses, "meshtrain: loss per step");
        std::printf("loss curve written to %s\n", c.plot.c_str());
      }
      std::fflush(stdout);
    }
  }
  return result;
}

}  // namespace train
}  // namespace meshtrain
