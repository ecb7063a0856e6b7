#include "meshtrain/train/trainer.h"

#include <ATen/ATen.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <string>
#include <signal.h>
#include <thread>
#include <unistd.h>

#include "engine.h"
#include "held_out.h"
#include "meshtrain/train/elastic.h"
#include "meshtrain/train/metrics.h"
#include "meshtrain/util/error.h"
#include "run_parts.h"

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

// "1m05s", "42s": elapsed time and ETA on progress lines.
std::string duration_text(double seconds) {
  const long s = std::lround(std::max(0.0, seconds));
  char buf[32];
  if (s >= 3600) std::snprintf(buf, sizeof buf, "%ldh%02ldm", s / 3600, s % 3600 / 60);
  else if (s >= 60) std::snprintf(buf, sizeof buf, "%ldm%02lds", s / 60, s % 60);
  else std::snprintf(buf, sizeof buf, "%lds", s);
  return buf;
}

// `elapsed`: since this run's first step, over `done` steps of it.
void print_progress(const TrainConfig& c, int64_t step, double loss, double grad_norm, double seconds, double elapsed,
                    int64_t done) {
  const double samples = c.global_batch / seconds;
  const double tokens = c.model.kind == "gpt" ? samples * c.model.seq_len : 0.0;
  const double eta = elapsed / std::max<int64_t>(1, done) * (c.steps - step - 1);
  std::printf("step %4lld/%d | loss %8.4f | grad norm %8.4f%s | %9.1f samples/s | %10.0f tokens/s | %7.3f s/step | "
              "rss %5.0f MiB | %s elapsed, ETA %s\n",
              static_cast<long long>(step + 1), c.steps, loss, grad_norm,
              c.clip_grad_norm > 0 && grad_norm > c.clip_grad_norm ? " (clipped)" : "", samples, tokens, seconds,
              current_rss_bytes() / 1048576.0, duration_text(elapsed).c_str(), duration_text(eta).c_str());
  std::fflush(stdout);
}

// Test hook: MESHTRAIN_TEST_KILL_AT_STEP=k on rank MESHTRAIN_TEST_KILL_RANK (default 1),
// first attempt only (MESHTRAIN_RESTART_COUNT unset or 0): SIGKILL shortly
// after step k starts, i.e. in the middle of the step. Returns whether it is
// armed: the step must then wait for the kill (wait_for_test_kill), or a fast
// step could finish, and even checkpoint, before it lands.
bool arm_test_kill(int64_t step) {
  const char* at = std::getenv("MESHTRAIN_TEST_KILL_AT_STEP");
  const char* restart = std::getenv("MESHTRAIN_RESTART_COUNT");
  if (!at || std::atoll(at) != step || (restart && std::atoi(restart) != 0)) return false;
  const char* who = std::getenv("MESHTRAIN_TEST_KILL_RANK");
  const char* rank = std::getenv("RANK");
  if ((who ? std::atoi(who) : 1) != (rank ? std::atoi(rank) : 0)) return false;
  // MESHTRAIN_TEST_KILL_TARGET=meshrun: the node's meshrun instead (a lost node).
  const char* target = std::getenv("MESHTRAIN_TEST_KILL_TARGET");
  const bool node = target && std::string(target) == "meshrun";
  std::thread([node] {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    std::fprintf(stderr, "test hook: killing %s (SIGKILL) in the middle of a step\n", node ? "this node's meshrun" : "this rank");
    std::fflush(stderr);
    kill(node ? getppid() : getpid(), SIGKILL);
  }).detach();
  return true;
}

[[noreturn]] void wait_for_test_kill() {
  for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
}

// --eval-every: the mean loss over the held-out global batches (held_out.h).
void record_held_out_loss(const TrainConfig& c, int64_t step, Engine& engine, const HeldOut& held_out,
                          comm::Communicator& metrics, bool print, TrainResult& result) {
  double sum = 0;
  for (int64_t b = 0; b < held_out.batches; ++b)
    sum += engine.evaluate(*held_out.data, held_out.first + b * c.global_batch, c.global_batch);
  at::Tensor loss = at::tensor({sum / held_out.batches}, at::kDouble);
  metrics.all_reduce(loss);  // the sum of the ranks' contributions, as for the training loss
  result.eval_steps.push_back(step + 1);
  result.eval_losses.push_back(loss.item<double>());
  if (print) std::printf("held-out loss after step %lld: %8.4f\n", static_cast<long long>(step + 1), result.eval_losses.back());
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

}  // namespace

TrainResult run_training(const TrainConfig& c, comm::CommPtr world, const RunOptions& options) {
  // Logging and reporting use their own communicator, so the training
  // communicators' traffic is the training's alone.
  comm::CommPtr metrics = world->split(0, world->rank(), "metrics");
  check_same_config(c, *metrics);  // a rank started with another --lr or --seed would train silently apart
  const bool chief = world->rank() == 0;
  std::unique_ptr<Engine> engine = make_engine(c, world);
  const HeldOut held_out = c.eval_every > 0 ? make_held_out(c) : HeldOut{};
  const Resumed resumed = resume_if_asked(c, *engine, *world, options.verbose);
  engine->reset_traffic();  // count steps, not set-up and loading
  CheckpointSaver saver(c, metrics, options.verbose);

  TrainResult result;
  result.first_step = resumed.first_step;
  const auto started = Clock::now();
  for (int64_t step = resumed.first_step; step < c.steps; ++step) {
    const bool killed_in_this_step = arm_test_kill(step);
    engine->set_learning_rate(learning_rate(c, step));
    const auto t0 = Clock::now();
    at::Tensor loss = at::tensor({engine->step(step)}, at::kDouble);
    if (killed_in_this_step) wait_for_test_kill();
    const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    metrics->all_reduce(loss);  // the sum of the ranks' contributions is the global-batch loss
    result.losses.push_back(loss.item<double>());
    result.step_times.push_back(seconds);
    result.grad_norms.push_back(engine->last_grad_norm());
    MESHTRAIN_CHECK(std::isfinite(result.grad_norms.back()), "step ", step + 1, ": the gradient norm is ",
                    result.grad_norms.back(), " (a gradient is not finite); lower --lr or clip with --clip-grad-norm");
    if (chief && options.verbose && step == resumed.first_step && step > 0) report_restart_time();
    if (chief && options.verbose && ((step + 1) % c.log_every == 0 || step + 1 == c.steps)) {
      print_progress(c, step, result.losses.back(), result.grad_norms.back(), seconds,
                     std::chrono::duration<double>(Clock::now() - started).count(), step + 1 - resumed.first_step);
    }
    if (c.eval_every > 0 && ((step + 1) % c.eval_every == 0 || step + 1 == c.steps))
      record_held_out_loss(c, step, *engine, held_out, *metrics, chief && options.verbose, result);
    const bool saved = saver.after_step(step, *engine);
    if (saved && step + 1 < c.steps && regroup_requested(*metrics)) {
      saver.finish();
      if (chief && options.verbose) {
        std::printf("a node is waiting to join: stopping after the checkpoint of step %lld for meshrun to regroup\n",
                    static_cast<long long>(step + 1));
      }
      result.stopped_for_regroup = true;
      return result;
    }
  }
  saver.finish();
  const std::string checkpoint_json = saver.json(resumed);
  const std::string pipeline_json = pipeline_report(c, *engine, *world, *metrics, options.verbose);
  finish_run(c, *engine, *world, *metrics, options, checkpoint_json, pipeline_json, result);
  return result;
}

}  // namespace train
}  // namespace meshtrain
