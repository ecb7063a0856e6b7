// Tensor parallelism (Megatron's MLP) on a user-defined model with plain
// torch::nn::Linear layers and its forward unchanged: fc1 is sliced by output
// features (column parallel), fc2 by input features (row parallel: one
// all-reduce forward, one backward). The slices are the dense layers' own
// values, so the parallel model starts as its dense twin; every rank sees the
// whole batch.
//   meshrun --nproc-per-node 2 -- build/bin/tensor_parallel
//
// Lines added to a one-process program (PyTorch: init_device_mesh and
// parallelize_module(model, mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})):
//   auto world = meshtrain::comm::init_from_env();
//   tp::parallelize(*model, world, {{"fc1", tp::Style::kColwise}, {"fc2", tp::Style::kRowwise}});
#include <torch/torch.h>

#include <iostream>

#include "meshtrain/comm.h"
#include "meshtrain/tp.h"

using namespace meshtrain;

struct Mlp : torch::nn::Module {  // the user's model, as written for one process
  torch::nn::Linear fc1{register_module("fc1", torch::nn::Linear(8, 64))};
  torch::nn::Linear fc2{register_module("fc2", torch::nn::Linear(64, 1))};
  torch::Tensor forward(torch::Tensor x) { return fc2(torch::relu(fc1(x))); }
};

int main() {
  auto world = comm::init_from_env();
  torch::manual_seed(0);  // every rank builds the same model
  auto model = std::make_shared<Mlp>();
  torch::manual_seed(0);
  auto dense = std::make_shared<Mlp>();  // a dense twin, only to show they start equal
  tp::parallelize(*model, world, {{"fc1", tp::Style::kColwise}, {"fc2", tp::Style::kRowwise}});
  torch::optim::Adam optimizer(model->parameters(), 1e-2);  // this rank's slices

  torch::manual_seed(1);
  auto probe = torch::randn({4, 8});
  const double start_diff = (model->forward(probe) - dense->forward(probe)).abs().max().item<double>();
  if (start_diff > 1e-5) {  // only float reassociation of fc2's sum may differ
    std::cerr << "the parallel model differs from the dense one by " << start_diff << "\n";
    return 1;
  }
  if (world->rank() == 0) {
    std::cout << "tp " << world->size() << ": fc1 keeps " << model->fc1->weight.size(0) << " of 64 rows; equal to the "
              << "dense model at the start (largest difference " << start_diff << ")\n";
  }
  for (int step = 0; step < 60; ++step) {
    torch::manual_seed(100 + step);  // the same batch on every rank
    auto x = torch::randn({32, 8});
    auto y = x.sin().sum(1, /*keepdim=*/true);
    optimizer.zero_grad();
    auto loss = torch::mse_loss(model->forward(x), y);
    loss.backward();
    optimizer.step();
    if (world->rank() == 0 && step % 20 == 19) std::cout << "step " << step + 1 << " loss " << loss.item<float>() << "\n";
  }
}
