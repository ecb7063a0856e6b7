// ZeRO stage 3 around a user-defined module: each layer is a unit whose full
// parameters exist only around its forward and its backward; between steps a
// rank holds 1/N of the parameters, gradients and Adam state.
//   meshrun --nproc-per-node 2 -- build/bin/zero
#include <torch/torch.h>

#include <iostream>

#include "meshtrain/comm/rendezvous.h"
#include "meshtrain/zero/zero.h"

struct Net : torch::nn::Module {
  torch::nn::Linear fc1{register_module("fc1", torch::nn::Linear(8, 64))};
  torch::nn::Linear fc2{register_module("fc2", torch::nn::Linear(64, 64))};
  torch::nn::Linear fc3{register_module("fc3", torch::nn::Linear(64, 1))};
};

int main() {
  auto world = meshtrain::comm::init_from_env();
  auto model = std::make_shared<Net>();
  auto adam = std::make_unique<torch::optim::AdamW>(model->parameters(), torch::optim::AdamWOptions(1e-2));
  meshtrain::zero::FullyShardedDataParallel fsdp(model, {model->fc1.ptr(), model->fc2.ptr(), model->fc3.ptr()},
                                                 std::move(adam), world);
  torch::manual_seed(world->rank());
  for (int step = 0; step < 60; ++step) {
    auto x = torch::randn({16, 8});
    auto y = x.sum(1, /*keepdim=*/true);
    fsdp.zero_grad();
    auto h = fsdp.run_unit(0, [&] { return torch::relu(model->fc1(x)); });  // gathers fc1, frees it after
    h = fsdp.run_unit(1, [&] { return torch::relu(model->fc2(h)); });
    auto out = fsdp.run_unit(2, [&] { return model->fc3(h); });
    auto loss = torch::mse_loss(out, y);
    loss.backward();  // units regathered before their backward; gradients reduce-scattered
    fsdp.step();      // each rank steps its shard
    if (world->rank() == 0 && step % 20 == 19) std::cout << "step " << step + 1 << " loss " << loss.item<float>() << "\n";
  }
  auto held = fsdp.held_bytes();
  std::cout << "rank " << world->rank() << " holds " << held.parameters << " B of parameters, " << held.optimizer
            << " B of Adam state\n";
}
