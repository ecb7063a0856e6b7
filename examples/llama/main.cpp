// The built-in Llama taken as a library (what `meshtrain --model llama` does,
// in your own loop): this rank builds its pipeline stage of the model, cuts it
// over tp with the model's plan (tp::parallelize with models::tp_plan: q, k,
// v, gate, up column-parallel, o and down row-parallel, the vocabulary
// split), and train::Trainer trains it on dp x pp x tp with ZeRO-1, from
// Hugging Face weights if given.
//   meshrun --nproc-per-node 8 -- build/bin/llama [HF_DIR]      (dp 2 x pp 2 x tp 2)
//   meshrun --nproc-per-node 4 -- build/bin/llama               (dp 1 x pp 2 x tp 2)
#include <torch/torch.h>

#include <iostream>
#include <memory>
#include <string>

#include "meshtrain/comm.h"
#include "meshtrain/io.h"
#include "meshtrain/mesh.h"
#include "meshtrain/models.h"
#include "meshtrain/pp.h"
#include "meshtrain/tp.h"
#include "meshtrain/train.h"

using namespace meshtrain;

// Byte tokens of a sentence repeated: sample i is the window starting at byte i.
std::pair<at::Tensor, at::Tensor> batch(int64_t first, int64_t count, int64_t seq_len) {
  const std::string text = "a small llama learns a sentence on a mesh of ranks; ";
  at::Tensor tokens = at::empty({count, seq_len + 1}, at::kLong);
  for (int64_t s = 0; s < count; ++s)
    for (int64_t t = 0; t <= seq_len; ++t) tokens[s][t] = static_cast<unsigned char>(text[(first + s + t) % text.size()]);
  return {tokens.narrow(1, 0, seq_len), tokens.narrow(1, 1, seq_len)};
}

int main(int argc, char** argv) {
  auto world = comm::init_from_env();
  models::ModelConfig config;  // a small Llama: 8 query heads sharing 4 key/value heads
  config.kind = "llama";
  config.layers = 4, config.hidden = 64, config.heads = 8, config.kv_heads = 4, config.vocab = 256;
  config.seq_len = 32, config.tie_embeddings = false;
  std::unique_ptr<io::LoadedWeights> weights;
  if (argc > 1) {  // a Hugging Face directory (config.json + safetensors): its shape and values
    weights = std::make_unique<io::LoadedWeights>(io::load_weights(argv[1]));
    config = weights->config;
    config.seq_len = 32;
  }
  const int pp = 2, tp = 2, dp = world->size() / (pp * tp);
  mesh::DeviceMesh mesh(world, mesh::MeshLayout(world->size(), mesh::MeshDims().dp(dp).pp(pp).tp(tp)));

  // This rank's stage: pieces [bounds[s], bounds[s+1]) of embedding, blocks, head.
  const std::vector<int64_t> bounds = pp::partition_balanced(std::vector<int64_t>(models::num_pieces(config), 1), pp);
  models::BuildContext ctx;
  if (weights) ctx.weights = &weights->tensors;
  const int s = mesh.coord().pp;
  models::Stage stage = models::build_stage(config, bounds[s], bounds[s + 1], ctx);
  weights.reset();  // the stage holds its values now
  tp::parallelize(*stage, mesh.tp(), models::tp_plan(config, *stage, tp, /*sequence_parallel=*/false));

  auto loss = train::model_loss(config, mesh.tp());  // the cross-entropy over tp's vocabulary slices
  auto adamw = [](std::vector<at::Tensor> p) { return std::make_unique<torch::optim::AdamW>(p, 3e-3); };
  train::Trainer trainer({pp::stage_module(stage)}, mesh, loss, adamw,
                         train::TrainerOptions().zero(1).pipeline(pp::PipelineOptions().microbatches(4)));
  const int64_t global_batch = 16, local = global_batch / dp;
  for (int step = 0; step < 30; ++step) {
    auto [x, y] = batch(step * global_batch + mesh.coord().dp * local, local, config.seq_len);
    const double mean = trainer.step(x, y);  // the global batch's loss, on every rank
    if (world->rank() == 0 && (step % 10 == 9 || step == 0)) std::cout << "step " << step + 1 << " loss " << mean << std::endl;
  }
  return 0;
}
