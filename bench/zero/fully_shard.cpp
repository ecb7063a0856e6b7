// What ZeRO-3 costs over DDP on the same model: a stack of MLP blocks trained
// as zero::fully_shard per block (units gathered by the dispatcher on first
// touch, forward unchanged) and as dp::replicate (DDP), steps interleaved in
// one run; bytes sent per step by each, and the parameter bytes a rank holds
// after backward.
//   meshrun --nproc-per-node 2 -- build/bin/bench_zero_fully_shard [hidden] [blocks] [batch] [steps]
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>

#include "meshtrain/comm.h"
#include "meshtrain/dp.h"
#include "meshtrain/zero.h"

using namespace meshtrain;

struct Block : torch::nn::Module {
  explicit Block(int64_t h) : fc1(register_module("fc1", torch::nn::Linear(h, 4 * h))), fc2(register_module("fc2", torch::nn::Linear(4 * h, h))) {}
  torch::Tensor forward(const torch::Tensor& x) { return x + fc2(torch::gelu(fc1(x))); }
  torch::nn::Linear fc1, fc2;
};

struct Stack : torch::nn::Module {
  Stack(int64_t h, int n) {
    torch::manual_seed(0);
    for (int i = 0; i < n; ++i) blocks.push_back(register_module("block" + std::to_string(i), std::make_shared<Block>(h)));
  }
  torch::Tensor forward(torch::Tensor x) {
    for (auto& b : blocks) x = b->forward(x);
    return x;
  }
  std::vector<std::shared_ptr<Block>> blocks;
};

struct Sample {
  double seconds;
  int64_t bytes_sent;
};

Sample timed(comm::Communicator& world, const std::function<void()>& step) {
  world.barrier();
  world.reset_traffic();
  const auto t0 = std::chrono::steady_clock::now();
  step();
  const int64_t sent = world.traffic().payload_total().bytes_sent;
  world.barrier();
  return {std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), sent};
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int main(int argc, char** argv) {
  auto world = comm::init_from_env();
  const int64_t hidden = argc > 1 ? std::atoll(argv[1]) : 256;
  const int blocks = argc > 2 ? std::atoi(argv[2]) : 4;
  const int64_t batch = argc > 3 ? std::atoll(argv[3]) : 64;
  const int steps = argc > 4 ? std::atoi(argv[4]) : 30;

  auto plain = std::make_shared<Stack>(hidden, blocks);
  for (auto& b : plain->blocks) zero::fully_shard(*b, world);
  torch::optim::SGD opt_plain(zero::sharded_parameters(*plain), 1e-3);

  auto ddp = dp::replicate(std::make_shared<Stack>(hidden, blocks), world);
  torch::optim::SGD opt_ddp(ddp->parameters(), 1e-3);

  torch::manual_seed(1 + world->rank());
  const auto x = torch::randn({batch, hidden});
  std::vector<double> t_plain, t_ddp;
  int64_t sent_plain = 0, sent_ddp = 0, held_plain = 0;
  for (int s = 0; s < steps + 3; ++s) {  // interleaved; the first 3 of each are warm-up
    const Sample a = timed(*world, [&] {
      opt_plain.zero_grad();
      plain->forward(x).pow(2).mean().backward();
      held_plain = zero::held_parameter_bytes(*plain);
      opt_plain.step();
    });
    const Sample b = timed(*world, [&] {
      opt_ddp.zero_grad();
      ddp->forward(x).pow(2).mean().backward();
      opt_ddp.step();
    });
    if (s >= 3) t_plain.push_back(a.seconds), t_ddp.push_back(b.seconds), sent_plain = a.bytes_sent, sent_ddp = b.bytes_sent;
  }
  if (world->rank() == 0) {
    int64_t full = 0;
    for (const auto& p : ddp->parameters()) full += p.numel() * p.element_size();
    std::printf("dp %d, %d blocks of MLP %lld -> %lld -> %lld (%lld B of parameters), batch %lld per rank, %d steps (median)\n",
                world->size(), blocks, (long long)hidden, (long long)(4 * hidden), (long long)hidden, (long long)full,
                (long long)batch, steps);
    std::printf("| | ms/step | bytes sent/step |\n|---|---|---|\n");
    std::printf("| zero::fully_shard per block | %.3f | %lld |\n", 1e3 * median(t_plain), (long long)sent_plain);
    std::printf("| dp::replicate (DDP) | %.3f | %lld |\n", 1e3 * median(t_ddp), (long long)sent_ddp);
    std::printf("ratio (fully_shard / DDP): time %.3f, bytes %.3f; fully_shard holds %lld B of parameters after backward\n",
                median(t_plain) / median(t_ddp), static_cast<double>(sent_plain) / static_cast<double>(sent_ddp),
                (long long)held_plain);
  }
}
