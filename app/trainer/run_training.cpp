#include "app/trainer/run_training.h"

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
#include "input_files.h"
#include "app/trainer/device_peak.h"
#include "app/trainer/elastic.h"
#include "meshtrain/train.h"
#include "train/mixed_precision.h"
#include "meshtrain/util.h"
#include "run_parts.h"
#include "stop_signal.h"

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

// What one step did, for the progress line and the streamed metrics.
struct StepFigures {
  int64_t step = 0;  // 0-based
  double loss = 0, grad_norm = 0, lr = 0, seconds = 0;
  double mfu = 0;  // model FLOPs / the ranks' measured matrix-product speed
  at::Tensor router_load;  // mixtures of experts: [layers, experts + 1] routes (dropped last), the whole step's
};

double tokens_per_sample(const TrainConfig& c) {
  return models::is_language_model(c.model) ? static_cast<double>(c.model.seq_len) : 1.0;
}

// `elapsed`: since this run's first step, over `done` steps of it.
void print_progress(const TrainConfig& c, const StepFigures& f, double elapsed, int64_t done) {
  const double samples = c.global_batch / f.seconds;
  const double eta = elapsed / std::max<int64_t>(1, done) * (c.steps - f.step - 1);
  char experts[96] = "";
  if (f.router_load.defined())
    std::snprintf(experts, sizeof experts, " | experts max/mean %.2f%s", router_imbalance(f.router_load),
                  c.model.capacity_factor > 0 ? str_cat(", dropped ", routes_dropped(f.router_load)).c_str() : "");
  std::printf("step %4lld/%d | loss %8.4f | lr %.2e | grad norm %8.4f%s | %9.1f samples/s | %10.0f tokens/s | "
              "MFU %5.1f%% | %7.3f s/step | rss %5.0f MiB%s | %s elapsed, ETA %s\n",
              static_cast<long long>(f.step + 1), c.steps, f.loss, f.lr, f.grad_norm,
              c.clip_grad_norm > 0 && f.grad_norm > c.clip_grad_norm ? " (clipped)" : "", samples,
              models::is_language_model(c.model) ? samples * c.model.seq_len : 0.0, 100 * f.mfu, f.seconds,
              current_rss_bytes() / 1048576.0, experts, duration_text(elapsed).c_str(), duration_text(eta).c_str());
  std::fflush(stdout);
}

// --metrics-out FILE: every step's figures as a JSON line in FILE.steps.jsonl
// as the step ends (a killed run keeps them); the whole run's JSON goes to
// FILE at the end. A resumed run appends.
class StepLog {
 public:
  StepLog(const TrainConfig& c, bool chief, bool resumed) : c_(c) {
    if (!chief || c.metrics_out.empty()) return;
    file_ = std::fopen((c.metrics_out + ".steps.jsonl").c_str(), resumed ? "a" : "w");
    MESHTRAIN_CHECK(file_, "--metrics-out ", c.metrics_out, ": cannot write ", c.metrics_out, ".steps.jsonl");
  }
  ~StepLog() {
    if (file_) std::fclose(file_);
  }
  void write(const StepFigures& f) {
    if (!file_) return;
    json::Object line;
    line.integer("step", f.step + 1).num("loss", f.loss).num("lr", f.lr)
        .num("grad_norm", f.grad_norm).num("seconds", f.seconds)
        .num("tokens_per_s", c_.global_batch * tokens_per_sample(c_) / f.seconds)
        .num("mfu", f.mfu);
    if (f.router_load.defined()) {
      line.raw("router_load", router_load_json(f.router_load)).num("router_imbalance", router_imbalance(f.router_load))
          .integer("moe_dropped", routes_dropped(f.router_load));
    }
    std::fprintf(file_, "%s\n", line.str().c_str());
    std::fflush(file_);
  }
  StepLog(const StepLog&) = delete;
  StepLog& operator=(const StepLog&) = delete;

 private:
  const TrainConfig& c_;
  std::FILE* file_ = nullptr;
};

// --tensorboard: the step's figures under torchtitan's and Lightning's tags.
void log_scalars(SummaryWriter& board, const TrainConfig& c, const StepFigures& f) {
  const int64_t step = f.step + 1;
  board.add_scalar("train/loss", f.loss, step);
  board.add_scalar("train/lr", f.lr, step);
  board.add_scalar("train/grad_norm", f.grad_norm, step);
  board.add_scalar("train/tokens_per_s", c.global_batch * tokens_per_sample(c) / f.seconds, step);
  board.add_scalar("train/mfu", f.mfu, step);
  board.add_scalar("train/step_time_s", f.seconds, step);
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

// What every rank must agree on at a step's end, carried by the loss's
// all-reduce (one collective per step): the global loss, and how many ranks
// saw an input file change, have hashed their input files, and were asked to
// stop (Notes [Input files are proven, then watched] and [SIGTERM stops at a
// step's end]).
struct StepVotes {
  double loss = 0;
  int changed = 0, hashed = 0, stopping = 0;
};

StepVotes vote(double loss, bool changed, bool hashed, bool stopping, comm::Communicator& metrics) {
  at::Tensor t = at::tensor({loss, changed ? 1.0 : 0.0, hashed ? 1.0 : 0.0, stopping ? 1.0 : 0.0}, at::kDouble);
  metrics.all_reduce(t);  // the sum of the ranks' contributions is the global-batch loss
  const double* v = t.data_ptr<double>();
  return {v[0], static_cast<int>(std::lround(v[1])), static_cast<int>(std::lround(v[2])),
          static_cast<int>(std::lround(v[3]))};
}

// After a step: a changed input file stops every rank; the input files'
// hashes are compared once every rank has them, and before anything is saved
// or reported (`must`). Returns whether they have been compared.
bool check_inputs(const StepVotes& votes, InputFiles& inputs, const std::string& my_change, bool compared, bool must,
                  int64_t step, comm::Communicator& metrics, bool print) {
  if (votes.changed > 0) stop_for_changed_input(my_change, metrics);
  if (compared || (votes.hashed < metrics.size() && !must)) return compared;
  check_same_inputs(inputs, metrics);
  if (print && inputs.count() > 0) {
    std::printf("input files the same on every rank: %zu file(s), %.1f MB, hashed in %.2f s (compared after step "
                "%lld)\n", inputs.count(), inputs.bytes() / 1e6, inputs.seconds(), static_cast<long long>(step + 1));
  }
  return true;
}

}  // namespace

TrainResult run_training(const TrainConfig& c, comm::CommPtr world, const RunOptions& options) {
  // Logging and reporting use their own communicator, so the training
  // communicators' traffic is the training's alone.
  comm::CommPtr metrics = world->split(0, world->rank(), "metrics");
  check_same_config(c, *metrics);  // a rank started with another --lr or --seed would train silently apart
  check_same_data(c, *metrics);    // the same path on another node may hold other bytes
  const SaveDirLock save_dir_lock = check_save_dir(c, *metrics);  // before anything is read from it or written to it
  prepare_outputs(c, *metrics);
  InputFiles inputs(input_files(c));  // hashed in the background while the model is built and trains
  const bool chief = world->rank() == 0;
  if (chief && options.verbose && c.precision == "bf16-mixed" && !bf16_products_accumulate_in_float()) {
    std::printf("warning: bf16-mixed: libtorch on this CPU (no AVX-512) accumulates bf16 matrix products in bf16, "
                "so gradients lose accuracy as micro-batches grow; --precision fp32 avoids it "
                "(Note [bf16 products on hosts without AVX-512])\n");
  }
  std::unique_ptr<Engine> engine = make_engine(c, world);
  const HeldOut held_out = c.eval_every > 0 ? make_held_out(c) : HeldOut{};
  const Resumed resumed = resume_if_asked(c, *engine, *world, options.verbose);
  engine->reset_traffic();  // count steps, not set-up and loading
  CheckpointSaver saver(c, metrics, options.verbose);

  TrainResult result;
  result.first_step = resumed.first_step;
  StepLog step_log(c, chief, resumed.first_step > 0);
  const std::unique_ptr<SummaryWriter> board =
      chief && !c.tensorboard.empty() ? std::make_unique<SummaryWriter>(c.tensorboard) : nullptr;
  const double flops_per_step = models::training_flops_per_token(c.model) * tokens_per_sample(c) * c.global_batch;
  result.peak = job_peak(c, *metrics);
  if (chief && options.verbose) print_peak(c, result.peak);
  result.model_flops_per_step = flops_per_step;
  const auto started = Clock::now();
  const std::unique_ptr<StopScope> stop_scope = c.save_dir.empty() ? nullptr : std::make_unique<StopScope>();
  bool inputs_compared = false;
  for (int64_t step = resumed.first_step; step < c.steps; ++step) {
    const bool killed_in_this_step = arm_test_kill(step);
    const double lr = learning_rate(c, step);
    engine->set_learning_rate(lr);
    const auto t0 = Clock::now();
    at::Tensor loss = at::tensor({engine->step(step)}, at::kDouble);
    if (killed_in_this_step) wait_for_test_kill();
    const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    const std::string my_change = inputs.first_change();
    const StepVotes votes =
        vote(loss.item<double>(), !my_change.empty(), inputs.hashed(), StopScope::requested(), *metrics);
    loss.fill_(votes.loss);
    const bool stopping = votes.stopping > 0;
    inputs_compared = check_inputs(votes, inputs, my_change, inputs_compared,
                                   stopping || saver.due(step) || step + 1 == c.steps, step, *metrics,
                                   chief && options.verbose);
    at::Tensor router_load = engine->take_router_load();
    if (router_load.defined()) {
      metrics->all_reduce(router_load);  // each rank's tokens through its layers
      result.router_load.push_back(router_load);
    }
    result.losses.push_back(loss.item<double>());
    result.step_times.push_back(seconds);
    result.grad_norms.push_back(engine->last_grad_norm());
    MESHTRAIN_CHECK(std::isfinite(result.grad_norms.back()), "step ", step + 1, ": the gradient norm is ",
                    result.grad_norms.back(), " (a gradient is not finite); lower --lr or clip with --clip-grad-norm");
    if (chief && options.verbose && step == resumed.first_step && step > 0) report_restart_time();
    const StepFigures figures{step, result.losses.back(), result.grad_norms.back(), lr, seconds,
                              flops_per_step / seconds / result.peak.flops, router_load};
    step_log.write(figures);
    if (board) log_scalars(*board, c, figures);
    result.learning_rates.push_back(lr);
    result.mfu.push_back(figures.mfu);
    if (chief && options.verbose && ((step + 1) % c.log_every == 0 || step + 1 == c.steps)) {
      print_progress(c, figures, std::chrono::duration<double>(Clock::now() - started).count(),
                     step + 1 - resumed.first_step);
    }
    if (c.eval_every > 0 && ((step + 1) % c.eval_every == 0 || step + 1 == c.steps)) {
      record_held_out_loss(c, step, *engine, held_out, *metrics, chief && options.verbose, result);
      if (board) board->add_scalar("eval/loss", result.eval_losses.back(), step + 1);
    }
    const bool saved = saver.after_step(step, *engine, stopping);
    if (stopping) {
      saver.finish();
      if (chief && options.verbose) {
        std::printf("stopped after step %lld: SIGTERM%s\n", static_cast<long long>(step + 1),
                    saved ? str_cat("; checkpoint step ", step + 1, " saved in ", c.save_dir,
                                    ": continue with --resume").c_str()
                          : "");
        std::fflush(stdout);
      }
      result.stopped_by_signal = true;
      return result;
    }
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
