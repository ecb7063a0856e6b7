// A user-defined model trained on a 3D layout, dp 2 x pp 2 x tp 2 = 8 ranks:
// each axis's communicator goes to the strategy that works along it.
//   tp: tp::parallelize splits the blocks' plain Linear layers (column, then row parallel)
//   pp: pp::pipeline cuts the Sequential between children and streams micro-batches
//   dp: dp::replicate averages the gradients of each stage's replicas; the
//       pipeline has it reduce on the last micro-batch only (no hooks to write)
//   meshrun --nproc-per-node 8 -- build/bin/mesh3d
#include <torch/torch.h>

#include <iostream>

#include "meshtrain/comm.h"
#include "meshtrain/dp.h"
#include "meshtrain/mesh.h"
#include "meshtrain/pp.h"
#include "meshtrain/tp.h"

using namespace meshtrain;

// x + W2 gelu(W1 x), written for one process; tp::parallelize splits W1 by
// rows and W2 by columns (one all-reduce each way).
struct BlockImpl : torch::nn::Module {
  torch::nn::Linear up{register_module("up", torch::nn::Linear(32, 128))};
  torch::nn::Linear down{register_module("down", torch::nn::Linear(128, 32))};
  torch::Tensor forward(torch::Tensor x) { return x + down(torch::gelu(up(x))); }
};
TORCH_MODULE(Block);

int main() {
  auto world = comm::init_from_env();
  mesh::DeviceMesh mesh(world, mesh::MeshLayout(world->size(), mesh::MeshDims().dp(2).pp(2).tp(2)));
  const mesh::Coord me = mesh.coord();
  torch::manual_seed(0);  // every rank builds the same model
  torch::nn::Sequential model(torch::nn::Linear(8, 32));
  for (int i = 0; i < 4; ++i) model->push_back(Block());
  model->push_back(torch::nn::Linear(32, 1));

  std::map<std::string, tp::Style> plan;  // children 1-4 are the blocks
  for (int i = 1; i <= 4; ++i) {
    plan[std::to_string(i) + ".up"] = tp::Style::kColwise;
    plan[std::to_string(i) + ".down"] = tp::Style::kRowwise;
  }
  tp::parallelize(*model, mesh.tp(), plan);  // along tp

  const int microbatches = 4;
  auto loss = [](const torch::Tensor& out, const torch::Tensor& target) { return torch::mse_loss(out, target); };
  auto stage = pp::pipeline(model, mesh.pp(), loss, pp::PipelineOptions().microbatches(microbatches));
  auto replicated = dp::replicate(stage.module(), mesh.dp());  // along dp only
  torch::optim::Adam optimizer(replicated->parameters(), 3e-3);

  for (int step = 0; step < 100; ++step) {
    torch::manual_seed(1000 * step + me.dp);  // each data-parallel replica its own batch
    auto x = torch::randn({16, 8});
    auto y = x.sin().sum(1, /*keepdim=*/true);
    optimizer.zero_grad();
    const double batch_loss = stage.step(x, y);
    optimizer.step();
    if (me.pp == 0 && me.tp == 0 && me.dp == 0 && step % 20 == 19) {
      std::cout << "step " << step + 1 << " loss " << batch_loss << " (rank " << world->rank() << ": dp " << me.dp
                << ", pp " << me.pp << ", tp " << me.tp << ")" << std::endl;
    }
  }
}
