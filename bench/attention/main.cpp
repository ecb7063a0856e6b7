// Eager vs flash attention in a whole model, one process: the activation
// bytes a forward keeps for backward (heap in use with the graph alive minus
// before), the planner's count of the same, and the forward + backward time,
// for growing T; then the longest T each kernel trains in a memory budget,
// as the planner predicts it (one micro-batch of one sample).
//   bench_attention [--seq-lens 1024,2048,...] [--budget-gib 4] [--layers 2]
//                   [--hidden 128] [--heads 4] [--kv-heads 2] [--vocab 512]
// Prints a markdown table (bench/attention/run.sh puts it in docs/BENCHMARKS.md).
#include <ATen/ATen.h>
#include <torch/autograd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "meshtrain/models.h"
#include "meshtrain/plan.h"
#include "app/trainer/config.h"
#include "app/trainer/memory_check.h"
#include "meshtrain/util.h"
#include "util/memory.h"
#include "util/strings.h"

using namespace meshtrain;

namespace {

double mib(int64_t bytes) { return bytes / 1048576.0; }

struct Options {
  std::vector<int64_t> seq_lens = {1024, 2048, 4096, 8192};
  double budget_gib = 4;
  models::ModelConfig model;
};

Options parse(int argc, char** argv) {
  Options o;
  o.model.kind = "llama";
  o.model.layers = 2, o.model.hidden = 128, o.model.heads = 4, o.model.kv_heads = 2, o.model.vocab = 512;
  o.model.tie_embeddings = false;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i], value = argv[i + 1];
    if (flag == "--seq-lens") {
      o.seq_lens.clear();
      for (const std::string& t : split(value, ',')) o.seq_lens.push_back(std::stoll(t));
    } else if (flag == "--budget-gib") {
      o.budget_gib = std::stod(value);
    } else if (flag == "--layers") {
      o.model.layers = std::stoll(value);
    } else if (flag == "--hidden") {
      o.model.hidden = std::stoll(value);
    } else if (flag == "--heads") {
      o.model.heads = std::stoll(value);
    } else if (flag == "--kv-heads") {
      o.model.kv_heads = std::stoll(value);
    } else if (flag == "--vocab") {
      o.model.vocab = std::stoll(value);
    } else {
      std::fprintf(stderr, "bench_attention: unknown flag %s\n", flag.c_str());
      std::exit(2);
    }
  }
  return o;
}

train::TrainConfig config_for(const models::ModelConfig& m, int64_t T, nn::AttentionKernel kernel) {
  train::TrainConfig c;
  c.model = m;
  c.model.seq_len = T;
  c.model.max_positions = T;
  c.model.attention = kernel;
  c.global_batch = c.micro_batch = 1;
  c.dp = c.pp = c.tp = 1;
  return c;
}

// The planner's figures for one process: activations and the whole total.
plan::MemoryBytes planned(const train::TrainConfig& c) {
  const plan::PlanInput in = train::planner_input(c, 1, int64_t{1} << 50);
  return plan::estimate_layout(in, plan::Layout{1, 1, 1, 0}).memory;
}

struct Measured {
  int64_t kept = 0;
  double seconds = 0;
};

Measured measure(const train::TrainConfig& c) {
  models::Stage model = models::build_stage(c.model, 0, models::num_pieces(c.model));
  const at::Tensor tokens = at::randint(c.model.vocab, {1, c.model.seq_len + 1}, at::kLong);
  const at::Tensor input = tokens.narrow(1, 0, c.model.seq_len), target = tokens.narrow(1, 1, c.model.seq_len);
  Measured best{0, 1e30};
  for (int run = 0; run < 2; ++run) {  // the first warms up (thread pool, allocator)
    model->zero_grad();
    const auto t0 = std::chrono::steady_clock::now();
    const int64_t before = heap_bytes_in_use();
    at::Tensor loss = models::loss(c.model, model->forward(input), target);
    const int64_t kept = heap_bytes_in_use() - before;
    loss.backward();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (run > 0) best = {kept, std::min(best.seconds, s)};
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  at::set_num_threads(1);
  const Options o = parse(argc, argv);
  const int64_t budget = static_cast<int64_t>(o.budget_gib * (int64_t{1} << 30));
  std::printf("Llama %lld layers, hidden %lld, %lld heads (%lld key/value), vocab %lld, fp32, one sample per step, "
              "one thread. Activations: heap bytes a forward keeps for backward (measured) and the planner's count; "
              "time: forward + backward, best of one after a warm-up.\n\n",
              (long long)o.model.layers, (long long)o.model.hidden, (long long)o.model.heads,
              (long long)o.model.kv_heads, (long long)o.model.vocab);
  std::printf("| T | kernel | activations measured (MiB) | planned (MiB) | measured / planned | "
              "forward + backward (s) | flash / eager time |\n|---:|---|---:|---:|---:|---:|---:|\n");
  for (const int64_t T : o.seq_lens) {
    double eager_seconds = 0;
    for (const auto kernel : {nn::AttentionKernel::kEager, nn::AttentionKernel::kFlash}) {
      const train::TrainConfig c = config_for(o.model, T, kernel);
      const plan::MemoryBytes plan = planned(c);
      const std::string name = nn::attention_kernel_name(kernel);
      if (plan.total() > budget) {
        std::printf("| %lld | %s | — | %.1f | — | needs %.2f GiB > %.1f: not run | |\n", (long long)T, name.c_str(),
                    mib(plan.activations), plan.total() / 1073741824.0, o.budget_gib);
        continue;
      }
      const Measured m = measure(c);
      const bool flash = kernel == nn::AttentionKernel::kFlash;
      if (!flash) eager_seconds = m.seconds;
      char ratio[32] = "";
      if (flash && eager_seconds > 0) std::snprintf(ratio, sizeof ratio, "%.2f", m.seconds / eager_seconds);
      std::printf("| %lld | %s | %.1f | %.1f | %.3f | %.3f | %s |\n", (long long)T, name.c_str(), mib(m.kept),
                  mib(plan.activations), static_cast<double>(m.kept) / plan.activations, m.seconds, ratio);
      std::fflush(stdout);
    }
  }
  // The longest T that fits the budget, per kernel, by the planner (doubling, then bisection).
  std::printf("\nLongest T whose planned total (parameters, gradients, Adam, activations) fits %.1f GiB:", o.budget_gib);
  for (const auto kernel : {nn::AttentionKernel::kEager, nn::AttentionKernel::kFlash}) {
    int64_t lo = 1, hi = 2;
    while (planned(config_for(o.model, hi, kernel)).total() <= budget) lo = hi, hi *= 2;
    while (hi - lo > 1) {
      const int64_t mid = (lo + hi) / 2;
      (planned(config_for(o.model, mid, kernel)).total() <= budget ? lo : hi) = mid;
    }
    std::printf(" %s %lld;", nn::attention_kernel_name(kernel).c_str(), (long long)lo);
  }
  std::printf("\n");
  return 0;
}
