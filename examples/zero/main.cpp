// ZeRO stage 3 (FSDP) on a user-defined module, its forward untouched: each
// layer is a unit whose full parameters exist only while its forward or its
// backward runs; between steps a rank holds 1/N of the parameters, gradients
// and Adam state.
//   meshrun --nproc-per-node 2 -- build/bin/zero
//
// Lines added to a one-process program (PyTorch 2: the same two, with
// `fully_shard(layer)` per layer; the optimizer, built after, takes
// model->parameters(), which are then the shards):
//   auto world = meshtrain::comm::init_from_env();
//   for (auto* layer : {&model->fc1, &model->fc2, &model->fc3}) zero::fully_shard(**layer, world);
#include <torch/torch.h>

#include <iostream>

#include "meshtrain/comm.h"
#include "meshtrain/zero.h"

using namespace meshtrain;

struct Net : torch::nn::Module {  // the user's model, as written for one process
  torch::nn::Linear fc1{register_module("fc1", torch::nn::Linear(8, 64))};
  torch::nn::Linear fc2{register_module("fc2", torch::nn::Linear(64, 64))};
  torch::nn::Linear fc3{register_module("fc3", torch::nn::Linear(64, 1))};
  torch::Tensor forward(torch::Tensor x) { return fc3(torch::relu(fc2(torch::relu(fc1(x))))); }
};

int main() {
  auto world = comm::init_from_env();
  torch::manual_seed(0);  // fully_shard starts every rank from rank 0's values; a seed makes runs repeat
  auto model = std::make_shared<Net>();
  for (auto* layer : {&model->fc1, &model->fc2, &model->fc3}) zero::fully_shard(**layer, world);
  torch::optim::AdamW adam(model->parameters(), torch::optim::AdamWOptions(1e-2));  // the shards
  torch::manual_seed(world->rank());  // each rank its own batches
  for (int step = 0; step < 60; ++step) {
    auto x = torch::randn({16, 8});
    auto y = x.sum(1, /*keepdim=*/true);
    adam.zero_grad();
    auto loss = torch::mse_loss(model->forward(x), y);  // each layer gathered on first use, freed when the next starts
    loss.backward();  // layers gathered again for their backward; gradients reduce-scattered
    adam.step();      // each rank steps its shard
    if (world->rank() == 0 && step % 20 == 19) std::cout << "step " << step + 1 << " loss " << loss.item<float>() << "\n";
  }
  int64_t full = 0;  // the module's parameters at full size (gathered: every rank calls it)
  for (const auto& kv : zero::full_parameters(*model)) full += kv.second.numel() * kv.second.element_size();
  int64_t adam_state = 0;
  for (const auto& kv : adam.state()) {
    const auto& s = static_cast<const torch::optim::AdamWParamState&>(*kv.second);
    adam_state += s.exp_avg().nbytes() + s.exp_avg_sq().nbytes();
  }
  const int64_t held = zero::held_parameter_bytes(*model);
  std::cout << "rank " << world->rank() << " holds " << held << " of " << full << " B of parameters and " << adam_state
            << " B of Adam state\n";
}
