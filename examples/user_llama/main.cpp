// A user's own Llama (llama.h: plain torch layers and nn pieces, written for
// one process) trained on a dp x cp x tp mesh, every axis applied from
// outside by the user's parallelize_llama (parallelize.h): tensor and
// sequence parallelism, context parallelism (ring attention), activation
// checkpointing and FSDP. The losses are those of one process up to float
// reassociation (tests/dist/test_user_llama.cpp checks it on several layouts):
//   build/bin/user_llama                                                      (one process)
//   meshrun --nproc-per-node 8 -- build/bin/user_llama --tp 2 --cp 2 --sequence-parallel --checkpoint   (dp 2)
// With --data 'shards_*.bin' it trains on token shards (llm.c's format, as
// `meshtrain data` writes them): global batch k is windows [8k, 8k + 8) of a
// seeded permutation, the same on every layout; each rank takes its part.
#include <torch/torch.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "meshtrain/meshtrain.h"
#include "parallelize.h"

using namespace meshtrain;

int main(int argc, char** argv) {
  int tp = 1, cp = 1, steps = 20;
  std::string data;  // token shards (a glob); empty: the synthetic counting sequences
  user_llama::Parallel p;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--tp" && i + 1 < argc) tp = std::atoi(argv[++i]);
    else if (a == "--cp" && i + 1 < argc) cp = std::atoi(argv[++i]);
    else if (a == "--steps" && i + 1 < argc) steps = std::atoi(argv[++i]);
    else if (a == "--data" && i + 1 < argc) data = argv[++i];
    else if (a == "--sequence-parallel") p.sequence_parallel = true;
    else if (a == "--checkpoint") p.checkpoint = true;
    else {
      std::fprintf(stderr, "usage: user_llama [--tp N] [--cp N] [--sequence-parallel] [--checkpoint] [--steps N] [--data GLOB]\n");
      return 2;
    }
  }
  auto world = comm::init_from_env();
  if (world->size() % (tp * cp) != 0) {
    std::fprintf(stderr, "user_llama: tp %d x cp %d does not divide the %d ranks\n", tp, cp, world->size());
    return 2;
  }
  const int dp = world->size() / (tp * cp);
  mesh::DeviceMesh mesh(world, mesh::MeshLayout(world->size(), mesh::MeshDims().dp(dp).tp(tp).cp(cp)));
  p.tp = mesh.tp();
  p.cp = mesh.cp();
  p.dp_cp = mesh.dp_cp();

  user_llama::Config config;
  std::unique_ptr<train::Dataset> shards;
  if (!data.empty()) {  // checked before the model is built: a bad file is named, never trained on
    const std::vector<std::string> paths = train::expand_data_paths(data);
    config.vocab = std::max<int64_t>(train::token_shards_vocab(paths), 256);  // 0 in llm.c's own shards: bytes
    train::check_token_shards(paths, config.vocab, config.seq_len);
    shards = train::make_token_shard_dataset(paths, config.seq_len, train::WindowOrder().seed(1).vocab(config.vocab));
  }
  models::Stage model = user_llama::build(config);  // the same values on every rank
  user_llama::parallelize(*model, config, p);
  torch::optim::AdamW adamw(model->parameters(), torch::optim::AdamWOptions(3e-3));  // this rank's shards

  const int64_t global_batch = 8;
  for (int step = 0; step < steps; ++step) {
    const auto [x, y] = shards ? [&] {
      const train::Batch b = shards->samples(step * global_batch, global_batch);
      return std::make_pair(b.inputs, b.targets);
    }() : user_llama::batch(config, step, global_batch);
    auto part = [&](const torch::Tensor& t) { return user_llama::my_part(t, dp, mesh.coord().dp, cp, mesh.coord().cp); };
    adamw.zero_grad();
    const torch::Tensor loss = user_llama::loss(model->forward(part(x)), part(y), p);
    loss.backward();  // gradients reduce-scattered over dp x cp into the shards
    adamw.step();
    torch::Tensor mean = loss.detach().reshape({1}).to(torch::kDouble);  // the global batch's: equal parts
    p.dp_cp->all_reduce(mean, comm::ReduceOp::kAvg);
    if (world->rank() == 0) std::printf("step %d loss %.9f\n", step + 1, mean.item<double>());
  }
  return 0;
}
