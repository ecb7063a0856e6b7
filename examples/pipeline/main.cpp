// Pipeline parallelism on a user-defined model whose blocks are not a plain
// sequence of layers (each has a residual connection inside): the model is a
// Sequential of blocks, cut between them; each rank keeps its stage and the
// 1F1B schedule streams micro-batches through.
//   meshrun --nproc-per-node 2 -- build/bin/pipeline
//
// Lines added to a one-process training loop (PyTorch's torch.distributed.pipelining:
// pipeline(...) + PipelineStage + Schedule 1F1B, about the same):
//   auto world = comm::init_from_env();
//   auto stage = pp::pipeline(model, world, loss, pp::PipelineOptions().microbatches(4));
//   ... stage->parameters() for the optimizer, stage.step(x, y) for forward + backward.
#include <torch/torch.h>

#include <iostream>

#include "meshtrain/comm.h"
#include "meshtrain/pp.h"

using namespace meshtrain;

struct ResidualBlockImpl : torch::nn::Module {  // y = x + W2 relu(W1 x): not a sequence, but one piece
  torch::nn::Linear a{register_module("a", torch::nn::Linear(32, 64))};
  torch::nn::Linear b{register_module("b", torch::nn::Linear(64, 32))};
  torch::Tensor forward(torch::Tensor x) { return x + b(torch::relu(a(x))); }
};
TORCH_MODULE(ResidualBlock);

int main() {
  auto world = comm::init_from_env();
  torch::manual_seed(0);  // every rank builds the same model, then keeps its stage
  torch::nn::Sequential model(torch::nn::Linear(8, 32));
  for (int i = 0; i < 6; ++i) model->push_back(ResidualBlock());
  model->push_back(torch::nn::Linear(32, 1));
  auto loss = [](const torch::Tensor& out, const torch::Tensor& target) { return torch::mse_loss(out, target); };
  auto stage = pp::pipeline(model, world, loss, pp::PipelineOptions().schedule("1f1b").microbatches(4));
  torch::optim::Adam optimizer(stage->parameters(), 1e-2);

  for (int step = 0; step < 100; ++step) {
    torch::manual_seed(step);  // the same batch everywhere: stage 0 uses inputs, the last stage targets
    auto x = torch::randn({32, 8});
    auto y = x.sin().sum(1, /*keepdim=*/true);
    optimizer.zero_grad();
    const double batch_loss = stage.step(x, y);  // forward and backward of every micro-batch
    optimizer.step();
    if (world->rank() == 0 && step % 20 == 19) {
      std::cout << "step " << step + 1 << " loss " << batch_loss << " (this rank holds children " << stage.first_child()
                << " to " << stage.last_child() - 1 << ")\n";
    }
  }
}
