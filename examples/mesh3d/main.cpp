// A user-defined model trained on a 3D layout, dp 2 x pp 2 x tp 2 = 8 ranks:
// each axis's communicator goes to the strategy that works along it.
//   tp: the blocks' layers split their weights (ColumnParallelLinear / RowParallelLinear)
//   pp: pp::pipeline cuts the Sequential between children and streams micro-batches
//   dp: dp::replicate averages the gradients of each stage's replicas; the
//       pipeline has it reduce on the last micro-batch only (no hooks to write)
//   meshrun --nproc-per-node 8 -- build/bin/mesh3d
#include <torch/torch.h>

#include <iostream>

#include "meshtrain/comm/rendezvous.h"
#include "meshtrain/dp/replicate.h"
#include "meshtrain/mesh/mesh.h"
#include "meshtrain/pp/pipeline.h"
#include "meshtrain/tp/layers.h"

using namespace meshtrain;

// x + W2 gelu(W1 x): W1 split by columns, W2 by rows over tp (one all-reduce each way).
struct BlockImpl : torch::nn::Module {
  BlockImpl(const comm::CommPtr& tp, const std::string& name) {
    up = register_module("up", tp::ColumnParallelLinear(tp::ColumnParallelLinearOptions(32, 128).tp(tp).name(name + ".up")));
    down = register_module("down", tp::RowParallelLinear(tp::RowParallelLinearOptions(128, 32).tp(tp).name(name + ".down")));
  }
  torch::Tensor forward(torch::Tensor x) { return x + down(torch::gelu(up(x))); }
  tp::ColumnParallelLinear up{nullptr};
  tp::RowParallelLinear down{nullptr};
};
TORCH_MODULE(Block);

int main() {
  auto world = comm::init_from_env();
  mesh::DeviceMesh mesh(world, mesh::MeshLayout(world->size(), /*dp=*/2, /*pp=*/2, /*tp=*/2));
  const mesh::Coord me = mesh.coord();
  torch::manual_seed(0);  // the plain layers: the same values on every rank
  torch::nn::Sequential model(torch::nn::Linear(8, 32));
  for (int i = 0; i < 4; ++i) model->push_back(Block(mesh.tp(), "block" + std::to_string(i)));
  model->push_back(torch::nn::Linear(32, 1));

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
