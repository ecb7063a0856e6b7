// A user-defined model trained on a 3D layout, dp 2 x pp 2 x tp 2 = 8 ranks:
// each axis's communicator goes to the strategy that works along it.
//   tp: the layers split their weights (ColumnParallelLinear / RowParallelLinear)
//   pp: the pipeline executor streams micro-batches between the stages
//   dp: DistributedDataParallel averages the gradients of each stage's replicas
//   meshrun --nproc-per-node 8 -- build/bin/mesh3d
#include <torch/torch.h>

#include <iostream>
#include <optional>

#include "meshtrain/comm/rendezvous.h"
#include "meshtrain/dp/ddp.h"
#include "meshtrain/mesh/mesh.h"
#include "meshtrain/pp/executor.h"
#include "meshtrain/tp/layers.h"

using namespace meshtrain;

// x + W2 gelu(W1 x): W1 split by columns, W2 by rows over tp (one all-reduce each way).
struct Block : torch::nn::Module {
  Block(const comm::CommPtr& tp, const std::string& name) {
    up = register_module("up", tp::ColumnParallelLinear(tp::ColumnParallelLinearOptions(32, 128).tp(tp).name(name + ".up")));
    down = register_module("down", tp::RowParallelLinear(tp::RowParallelLinearOptions(128, 32).tp(tp).name(name + ".down")));
  }
  torch::Tensor forward(torch::Tensor x) { return x + down(torch::gelu(up(x))); }
  tp::ColumnParallelLinear up{nullptr};
  tp::RowParallelLinear down{nullptr};
};

// One pipeline stage: two blocks (the first stage also embeds the input, the last reads out).
struct Stage : torch::nn::Module {
  Stage(const comm::CommPtr& tp, int stage, int stages) : first(stage == 0), last(stage == stages - 1) {
    if (first) in = register_module("in", torch::nn::Linear(8, 32));
    for (int i = 0; i < 2; ++i) blocks.push_back(register_module("block" + std::to_string(i), std::make_shared<Block>(tp, "s" + std::to_string(stage) + "b" + std::to_string(i))));
    if (last) out = register_module("out", torch::nn::Linear(32, 1));
  }
  torch::Tensor forward(torch::Tensor x) {
    if (first) x = in(x);
    for (auto& b : blocks) x = b->forward(x);
    return last ? out(x) : x;
  }
  bool first, last;
  torch::nn::Linear in{nullptr}, out{nullptr};
  std::vector<std::shared_ptr<Block>> blocks;
};

int main() {
  auto world = comm::init_from_env();
  mesh::DeviceMesh mesh(world, mesh::MeshLayout(world->size(), /*dp=*/2, /*pp=*/2, /*tp=*/2));
  const mesh::Coord me = mesh.coord();
  torch::manual_seed(me.pp);  // the plain layers: same values on the tp and dp replicas of a stage
  auto stage = std::make_shared<Stage>(mesh.tp(), me.pp, 2);
  dp::DistributedDataParallel ddp(stage, mesh.dp());  // along dp only
  torch::optim::Adam optimizer(stage->parameters(), 3e-3);
  const int microbatches = 4;
  pp::PipelineExecutor pipeline(mesh.pp(), pp::ScheduleSpec{"1f1b", 2, microbatches, 1},
                                {{me.pp, [&](const torch::Tensor& x, int) { return stage->forward(x); }}});
  std::optional<dp::DistributedDataParallel::NoSync> no_sync;
  pp::PipelineHooks hooks;  // synchronize gradients over dp on the last micro-batch only
  hooks.before_backward = [&](int, int mb) { if (mb < microbatches - 1) no_sync.emplace(ddp.no_sync()); };
  hooks.after_backward = [&](int, int) { no_sync.reset(); };

  for (int step = 0; step < 100; ++step) {
    torch::manual_seed(1000 * step + me.dp);  // each data-parallel replica its own batch
    auto x = torch::randn({16, 8});
    auto y = x.sin().sum(1, /*keepdim=*/true);
    optimizer.zero_grad();
    auto r = pipeline.run(x.chunk(microbatches), y.chunk(microbatches),
                          [&](const torch::Tensor& out, const torch::Tensor& t, int) { return torch::mse_loss(out, t) / microbatches; },
                          hooks);
    optimizer.step();
    if (stage->last && me.tp == 0 && me.dp == 0 && step % 20 == 19) {
      std::cout << "step " << step + 1 << " loss " << r.loss_sum << " (rank " << world->rank() << ": dp " << me.dp
                << ", pp " << me.pp << ", tp " << me.tp << ")" << std::endl;
    }
  }
}
