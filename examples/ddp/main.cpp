// DistributedDataParallel around a user-defined module; its forward is untouched.
//   meshrun --nproc-per-node 2 -- build/bin/ddp
//
// Lines added to a one-process training loop (PyTorch: the same two, with
// `DistributedDataParallel(model)` and `init_process_group`):
//   auto world = meshtrain::comm::init_from_env();
//   auto model = meshtrain::dp::replicate(std::make_shared<Net>(), world);
#include <torch/torch.h>

#include <iostream>

#include "meshtrain/comm.h"
#include "meshtrain/dp.h"

struct Net : torch::nn::Module {
  torch::nn::Linear fc1{register_module("fc1", torch::nn::Linear(8, 32))};
  torch::nn::Linear fc2{register_module("fc2", torch::nn::Linear(32, 1))};
  torch::Tensor forward(torch::Tensor x) { return fc2(torch::relu(fc1(x))); }
};

int main() {
  auto world = meshtrain::comm::init_from_env();
  auto model = meshtrain::dp::replicate(std::make_shared<Net>(), world);  // same weights everywhere from here
  torch::optim::SGD optimizer(model->parameters(), /*lr=*/0.05);

  torch::manual_seed(world->rank());  // each rank its own data
  for (int step = 0; step < 50; ++step) {
    auto x = torch::randn({16, 8});
    auto y = x.sum(1, /*keepdim=*/true);  // learn to add up the inputs
    optimizer.zero_grad();
    auto loss = torch::mse_loss(model->forward(x), y);
    loss.backward();  // gradients are averaged over the ranks here
    optimizer.step();
    if (world->rank() == 0 && step % 10 == 9) std::cout << "step " << step + 1 << " loss " << loss.item<float>() << "\n";
  }
}
