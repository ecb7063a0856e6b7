// Tensor parallelism (Megatron's MLP) on a user-defined model: the user's
// dense layers are sliced over the ranks, fc1 by output features (column
// parallel), fc2 by input features (row parallel: one all-reduce forward, one
// backward). The parallel model is built from the dense one, so both start
// equal by construction; every rank sees the whole batch.
//   meshrun --nproc-per-node 2 -- build/bin/tensor_parallel
//
// Lines added to a one-process program (PyTorch: parallelize_module with a
// ColwiseParallel / RowwiseParallel plan, about the same):
//   auto world = meshtrain::comm::init_from_env();
//   ParallelMlp model(dense, world);   // + the 3-line ParallelMlp (column_parallel, row_parallel)
#include <torch/torch.h>

#include <iostream>

#include "meshtrain/comm/rendezvous.h"
#include "meshtrain/tp/layers.h"

using namespace meshtrain;

struct Mlp : torch::nn::Module {  // the user's dense model
  torch::nn::Linear fc1{register_module("fc1", torch::nn::Linear(8, 64))};
  torch::nn::Linear fc2{register_module("fc2", torch::nn::Linear(64, 1))};
  torch::Tensor forward(torch::Tensor x) { return fc2(torch::relu(fc1(x))); }
};

struct ParallelMlp : torch::nn::Module {  // the same forward, each layer a slice of the dense one
  ParallelMlp(const Mlp& dense, comm::CommPtr tp)
      : fc1(register_module("fc1", tp::column_parallel(dense.fc1, tp))),
        fc2(register_module("fc2", tp::row_parallel(dense.fc2, tp))) {}
  torch::Tensor forward(torch::Tensor x) { return fc2(torch::relu(fc1(x))); }
  tp::ColumnParallelLinear fc1;
  tp::RowParallelLinear fc2;
};

int main() {
  auto world = comm::init_from_env();
  torch::manual_seed(0);  // every rank builds the same dense model
  Mlp dense;
  ParallelMlp model(dense, world);
  torch::optim::Adam optimizer(model.parameters(), 1e-2);  // this rank's slices

  torch::manual_seed(1);
  auto probe = torch::randn({4, 8});
  const double start_diff = (model.forward(probe) - dense.forward(probe)).abs().max().item<double>();
  if (start_diff > 1e-5) {  // only float reassociation of fc2's sum may differ
    std::cerr << "the parallel model differs from the dense one by " << start_diff << "\n";
    return 1;
  }
  if (world->rank() == 0) std::cout << "tp " << world->size() << ": equal to the dense model at the start (largest difference " << start_diff << ")\n";
  for (int step = 0; step < 60; ++step) {
    torch::manual_seed(100 + step);  // the same batch on every rank
    auto x = torch::randn({32, 8});
    auto y = x.sin().sum(1, /*keepdim=*/true);
    optimizer.zero_grad();
    auto loss = torch::mse_loss(model.forward(x), y);
    loss.backward();
    optimizer.step();
    if (world->rank() == 0 && step % 20 == 19) std::cout << "step " << step + 1 << " loss " << loss.item<float>() << "\n";
  }
}
