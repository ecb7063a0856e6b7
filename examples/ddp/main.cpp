// DistributedDataParallel around a user-defined module.
//   meshrun --nproc-per-node 2 -- build/bin/ddp
#include <torch/torch.h>

#include <iostream>

#include "meshtrain/comm/rendezvous.h"
#include "meshtrain/dp/ddp.h"

struct Net : torch::nn::Module {
  torch::nn::Linear fc1{register_module("fc1", torch::nn::Linear(8, 32))};
  torch::nn::Linear fc2{register_module("fc2", torch::nn::Linear(32, 1))};
  torch::Tensor forward(torch::Tensor x) { return fc2(torch::relu(fc1(x))); }
};

int main() {
  auto world = meshtrain::comm::init_from_env();
  auto model = std::make_shared<Net>();
  meshtrain::dp::DistributedDataParallel ddp(model, world);  // same weights everywhere from here
  torch::optim::SGD optimizer(model->parameters(), /*lr=*/0.05);

  torch::manual_seed(world->rank());  // each rank its own data
  for (int step = 0; step < 50; ++step) {
    auto x = torch::randn({16, 8});
    auto y = x.sum(1, /*keepdim=*/true);  // learn to add up the inputs
    optimizer.zero_grad();
    auto loss = torch::mse_loss(ddp.forward([&] { return model->forward(x); }), y);
    loss.backward();  // gradients are averaged over the ranks here
    optimizer.step();
    if (world->rank() == 0 && step % 10 == 9) std::cout << "step " << step + 1 << " loss " << loss.item<float>() << "\n";
  }
}
