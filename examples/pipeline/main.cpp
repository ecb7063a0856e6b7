// Pipeline parallelism on a user-defined model whose blocks are not a plain
// sequence of layers (each has a residual connection inside): cut it between
// blocks, give each rank its stage, and let the 1F1B schedule stream
// micro-batches through.
//   meshrun --nproc-per-node 2 -- build/bin/pipeline
#include <torch/torch.h>

#include <iostream>

#include "meshtrain/comm/rendezvous.h"
#include "meshtrain/pp/executor.h"

using namespace meshtrain;

struct ResidualBlock : torch::nn::Module {  // y = x + W2 relu(W1 x): not a sequence, but one piece
  torch::nn::Linear a{register_module("a", torch::nn::Linear(32, 64))};
  torch::nn::Linear b{register_module("b", torch::nn::Linear(64, 32))};
  torch::Tensor forward(torch::Tensor x) { return x + b(torch::relu(a(x))); }
};

int main() {
  auto world = comm::init_from_env();
  const int p = world->size(), rank = world->rank(), microbatches = 4;
  // Every rank builds the same pieces from the same seed, then keeps its own.
  torch::manual_seed(0);
  std::vector<torch::nn::AnyModule> pieces = {torch::nn::AnyModule(torch::nn::Linear(8, 32))};
  for (int i = 0; i < 6; ++i) pieces.emplace_back(std::make_shared<ResidualBlock>());
  pieces.emplace_back(torch::nn::Linear(32, 1));
  const auto bounds = pp::partition_balanced(std::vector<int64_t>(pieces.size(), 1), p);  // cut between pieces
  std::vector<torch::Tensor> params;
  for (int64_t i = bounds[rank]; i < bounds[rank + 1]; ++i)
    for (auto& t : pieces[i].ptr()->parameters()) params.push_back(t);
  torch::optim::Adam optimizer(params, 1e-2);
  pp::StageFn stage{rank, [&](const torch::Tensor& x, int) {
                      torch::Tensor h = x;
                      for (int64_t i = bounds[rank]; i < bounds[rank + 1]; ++i) h = pieces[i].forward(h);
                      return h;
                    }};
  pp::PipelineExecutor pipeline(world, pp::ScheduleSpec{"1f1b", p, microbatches, 1}, {stage});

  for (int step = 0; step < 100; ++step) {
    torch::manual_seed(step);  // the same batch everywhere: stage 0 uses inputs, the last stage targets
    auto x = torch::randn({32, 8});
    auto y = x.sin().sum(1, /*keepdim=*/true);
    optimizer.zero_grad();
    auto result = pipeline.run(x.chunk(microbatches), y.chunk(microbatches),
                               [&](const torch::Tensor& out, const torch::Tensor& t, int) {
                                 return torch::mse_loss(out, t) / microbatches;
                               });
    optimizer.step();
    if (rank == p - 1 && step % 20 == 19) std::cout << "step " << step + 1 << " loss " << result.loss_sum << "\n";
  }
}
