// The article's master-based DP around a user-defined module: rank 0 reads the
// batch, computes the loss over the whole batch and steps the optimizer.
//   meshrun --nproc-per-node 3 -- build/bin/master_dp
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
  auto model = std::make_shared<Net>();
  auto mse = [](const torch::Tensor& y, const torch::Tensor& t) { return torch::mse_loss(y, t); };
  meshtrain::dp::MasterDataParallel dp(model, world, mse);
  torch::optim::SGD optimizer(model->parameters(), /*lr=*/0.05);  // only rank 0's is used

  torch::manual_seed(0);
  for (int step = 0; step < 50; ++step) {
    torch::Tensor x, y;
    if (world->rank() == 0) {  // only the master reads data
      x = torch::randn({48, 8});
      y = x.sum(1, /*keepdim=*/true);
      optimizer.zero_grad();
    }
    auto loss = dp.step(x, y, [&](const torch::Tensor& in) { return model->forward(in); });
    if (world->rank() == 0) {
      optimizer.step();
      if (step % 10 == 9) std::cout << "step " << step + 1 << " loss " << loss.item<float>() << "\n";
    }
  }
}
