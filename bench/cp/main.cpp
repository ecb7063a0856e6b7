// Context parallelism at long sequences: a Llama's activation bytes per rank
// (heap a forward keeps for backward: in use with the graph alive minus
// before, the largest over the ranks) and forward + backward time on cp
// ranks (ring attention), against the planner's count for the same layout;
// then the longest T whose planned total fits the budget per rank, for cp 1,
// 2, 4 (the planner's prediction the measured rows check).
//   meshrun --nproc-per-node C -- bench_cp [--seq-lens 1024,...] [--budget-gib 4]
// One cp group of every rank. Prints markdown table rows on rank 0
// (bench/cp/run.sh runs cp 1, 2, 4 and puts the table in docs/BENCHMARKS.md).
#include <ATen/ATen.h>

#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "meshtrain/comm.h"
#include "meshtrain/cp.h"
#include "meshtrain/models.h"
#include "meshtrain/plan.h"
#include "app/trainer/config.h"
#include "app/trainer/memory_check.h"
#include "util/memory.h"
#include "util/strings.h"

using namespace meshtrain;

namespace {

double mib(int64_t bytes) { return bytes / 1048576.0; }

models::ModelConfig llama(int64_t T) {
  models::ModelConfig m;
  m.kind = "llama";
  m.layers = 2, m.hidden = 128, m.heads = 4, m.kv_heads = 2, m.vocab = 512;
  m.tie_embeddings = false;
  m.seq_len = m.max_positions = T;
  m.attention = nn::AttentionKernel::kFlash;  // cp 1: flash, as each cp rank's ring
  return m;
}

// The planner's one-rank figures for cp ranks of one sample of T positions.
plan::MemoryBytes planned(int64_t T, int cp) {
  train::TrainConfig c;
  c.model = llama(T);
  c.global_batch = c.micro_batch = 1;
  c.cp = cp;
  const plan::PlanInput in = train::planner_input(c, cp, int64_t{1} << 50);
  return plan::estimate_layout(in, plan::Layout{1, 1, 1, 0, cp}).memory;
}

struct Measured {
  int64_t kept = 0;
  double seconds = 0;
};

Measured measure(int64_t T, const comm::CommPtr& world) {
  const int cp = world->size();
  const models::ModelConfig m = llama(T);
  models::Stage model = models::build_stage(m, 0, models::num_pieces(m));
  cp::parallelize(*model, world);  // ring attention over every rank (cp 1: nothing)
  at::manual_seed(1);  // the same sequence on every rank; each takes its chunks
  const at::Tensor tokens = at::randint(m.vocab, {1, T + 1}, at::kLong);
  at::Tensor input = tokens.narrow(1, 0, T), target = tokens.narrow(1, 1, T);
  if (cp > 1) {
    input = cp::shard_sequence(input, 1, cp, world->rank());
    target = cp::shard_sequence(target, 1, cp, world->rank());
  }
  Measured best{0, 1e30};
  for (int run = 0; run < 2; ++run) {  // the first warms up (thread pool, allocator)
    model->zero_grad();
    world->barrier();
    const auto t0 = std::chrono::steady_clock::now();
    const int64_t before = heap_bytes_in_use();
    at::Tensor loss = models::loss(m, model->forward(input), target);
    const int64_t kept = heap_bytes_in_use() - before;
    loss.backward();
    world->barrier();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (run > 0) best = {kept, s};
  }
  at::Tensor most = at::tensor({static_cast<double>(best.kept)}, at::kDouble);
  world->all_reduce(most, comm::ReduceOp::kMax);
  best.kept = static_cast<int64_t>(most.item<double>());
  return best;
}

int64_t longest_fitting(int cp, int64_t budget) {
  int64_t lo = 2 * cp, hi = 4 * cp;
  while (planned(hi, cp).total() <= budget) lo = hi, hi *= 2;
  while (hi - lo > 2 * cp) {
    const int64_t mid = (lo + hi) / 2 / (2 * cp) * (2 * cp);  // 2 cp divides T
    (planned(mid, cp).total() <= budget ? lo : hi) = mid;
  }
  return lo;
}

}  // namespace

int main(int argc, char** argv) {
  at::set_num_threads(1);
  std::vector<int64_t> seq_lens = {1024, 2048, 4096, 8192};
  double budget_gib = 4;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i], value = argv[i + 1];
    if (flag == "--seq-lens") {
      seq_lens.clear();
      for (const std::string& t : split(value, ',')) seq_lens.push_back(std::stoll(t));
    } else if (flag == "--budget-gib") {
      budget_gib = std::stod(value);
    } else {
      std::fprintf(stderr, "bench_cp: unknown flag %s\n", flag.c_str());
      return 2;
    }
  }
  const comm::CommPtr world = comm::init_from_env();
  const int cp = world->size();
  const int64_t budget = static_cast<int64_t>(budget_gib * (int64_t{1} << 30));
  for (const int64_t T : seq_lens) {
    const plan::MemoryBytes plan = planned(T, cp);
    const Measured got = measure(T, world);
    if (world->rank() == 0) {
      std::printf("| %d | %lld | %lld | %.1f | %.1f | %.3f | %.3f |\n", cp, (long long)T, (long long)(T / cp),
                  mib(got.kept), mib(plan.activations), static_cast<double>(got.kept) / plan.activations,
                  got.seconds);
      std::fflush(stdout);
    }
  }
  if (world->rank() == 0)
    std::printf("LONGEST %d %lld %.1f\n", cp, (long long)longest_fitting(cp, budget), budget_gib);
  return 0;
}
