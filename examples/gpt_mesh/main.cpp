// A user's GPT-like model, written for one process, trained on dp 2 x pp 2 x
// tp 2 = 8 ranks with ZeRO-3 along dp: every strategy applied to the module
// as it is, each to its axis of the mesh.
//   meshrun --nproc-per-node 8 -- build/bin/gpt_mesh
//
// Lines added to the one-process program (each strategy one call):
//   auto world = meshtrain::comm::init_from_env();
//   mesh::DeviceMesh mesh(world, mesh::MeshLayout(world->size(), mesh::MeshDims().dp(2).pp(2).tp(2)));
//   tp::parallelize(*model, mesh.tp(), plan);                   // Megatron's embedding, attention and MLP split
//   auto stage = pp::pipeline(model, mesh.pp(), loss, options); // this rank's blocks; micro-batches streamed
//   for (auto& layer : stage->children()) zero::fully_shard(*layer, mesh.dp());
// (and the loop calls stage.step(x, y); the optimizer takes stage->parameters(): the shards).
//
// Or the same calls in one object, train::Trainer (with the global gradient
// norm clipped):                meshrun --nproc-per-node 8 -- build/bin/gpt_mesh --trainer
//   train::Trainer trainer(model, mesh, loss, make_adamw, train::TrainerOptions().zero(3).tp_plan(plan)
//                              .pipeline(pp::PipelineOptions().microbatches(4)).clip_grad_norm(1.0));
// (and the loop calls trainer.step(x, y)).
// The plan names the layers (the attention's forward reads its head count
// from the tensor, view(B, T, -1, head_dim), so it runs unchanged on the
// heads a tp rank holds).
#include <torch/torch.h>

#include <cmath>
#include <functional>
#include <iostream>

#include "meshtrain/comm.h"
#include "meshtrain/mesh.h"
#include "meshtrain/pp.h"
#include "meshtrain/train.h"
#include "meshtrain/tp.h"
#include "meshtrain/zero.h"

using namespace meshtrain;

constexpr int64_t kVocab = 32, kContext = 16, kDim = 64, kHeadDim = 16, kBlocks = 4;

// ---- the user's model, as written for one process

struct EmbedImpl : torch::nn::Module {
  torch::nn::Embedding tokens{register_module("tokens", torch::nn::Embedding(kVocab, kDim))};
  torch::nn::Embedding positions{register_module("positions", torch::nn::Embedding(kContext, kDim))};
  torch::Tensor forward(torch::Tensor ids) { return tokens(ids) + positions(torch::arange(ids.size(1))); }
};
TORCH_MODULE(Embed);

struct BlockImpl : torch::nn::Module {
  torch::nn::LayerNorm ln1{register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kDim})))};
  torch::nn::Linear q{register_module("q", torch::nn::Linear(kDim, kDim))};
  torch::nn::Linear k{register_module("k", torch::nn::Linear(kDim, kDim))};
  torch::nn::Linear v{register_module("v", torch::nn::Linear(kDim, kDim))};
  torch::nn::Linear out{register_module("out", torch::nn::Linear(kDim, kDim))};
  torch::nn::LayerNorm ln2{register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kDim})))};
  torch::nn::Linear fc1{register_module("fc1", torch::nn::Linear(kDim, 4 * kDim))};
  torch::nn::Linear fc2{register_module("fc2", torch::nn::Linear(4 * kDim, kDim))};

  torch::Tensor attention(torch::Tensor x) {
    const int64_t B = x.size(0), T = x.size(1);
    auto heads = [&](torch::Tensor t) { return t.view({B, T, -1, kHeadDim}).transpose(1, 2); };
    auto scores = torch::matmul(heads(q(x)), heads(k(x)).transpose(-2, -1)) / std::sqrt(double(kHeadDim));
    scores = scores.masked_fill(torch::ones({T, T}, torch::kBool).triu(1), -INFINITY);
    auto mixed = torch::matmul(torch::softmax(scores, -1), heads(v(x)));
    return out(mixed.transpose(1, 2).reshape({B, T, -1}));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = x + attention(ln1(x));
    return x + fc2(torch::gelu(fc1(ln2(x))));
  }
};
TORCH_MODULE(Block);

struct HeadImpl : torch::nn::Module {
  torch::nn::LayerNorm ln{register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kDim})))};
  torch::nn::Linear logits{register_module("logits", torch::nn::Linear(kDim, kVocab))};
  torch::Tensor forward(torch::Tensor x) { return logits(ln(x)); }
};
TORCH_MODULE(Head);

// Sequences that count up by a step of 1, 2 or 3 (mod the vocabulary): the
// model must read the step from the context.
std::pair<torch::Tensor, torch::Tensor> batch(int64_t size) {
  auto start = torch::randint(kVocab, {size, 1}, torch::kLong);
  auto stride = torch::randint(1, 4, {size, 1}, torch::kLong);
  auto seq = (start + stride * torch::arange(kContext + 1)).remainder(kVocab);
  return {seq.narrow(1, 0, kContext), seq.narrow(1, 1, kContext)};
}

std::map<std::string, tp::Style> tp_plan() {
  std::map<std::string, tp::Style> plan = {{"0.tokens", tp::Style::kVocabParallel}};  // children 1..kBlocks are the blocks
  for (int i = 1; i <= kBlocks; ++i) {
    for (const char* col : {"q", "k", "v", "fc1"}) plan[std::to_string(i) + "." + col] = tp::Style::kColwise;
    for (const char* row : {"out", "fc2"}) plan[std::to_string(i) + "." + row] = tp::Style::kRowwise;
  }
  return plan;
}

torch::Tensor loss(const torch::Tensor& logits, const torch::Tensor& targets) {
  return torch::cross_entropy_loss(logits.reshape({-1, kVocab}), targets.reshape({-1}));
}

std::unique_ptr<torch::optim::Optimizer> make_adamw(std::vector<torch::Tensor> params) {
  return std::make_unique<torch::optim::AdamW>(params, torch::optim::AdamWOptions(3e-3).weight_decay(0));
}

// 150 steps; `step` trains on (x, y) and returns the loss; printed by one rank.
void train_steps(const mesh::Coord& me, bool prints, const std::function<double(torch::Tensor, torch::Tensor)>& step) {
  for (int i = 0; i < 150; ++i) {
    torch::manual_seed(1000 * i + me.dp);  // each data-parallel replica its own batch
    auto [x, y] = batch(16);
    const double batch_loss = step(x, y);
    if (prints && i % 30 == 29) std::cout << "step " << i + 1 << " loss " << batch_loss << std::endl;
  }
}

void report(const comm::Communicator& world, const mesh::Coord& me, const std::map<std::string, torch::Tensor>& full,
            const torch::nn::Module& stage) {
  int64_t bytes = 0;  // this rank's tp slices of its stage, at full size over dp
  for (const auto& kv : full) bytes += kv.second.numel() * kv.second.element_size();
  std::cout << "rank " << world.rank() << " (dp " << me.dp << ", pp " << me.pp << ", tp " << me.tp << ") holds "
            << zero::held_parameter_bytes(stage) << " of its stage's " << bytes << " B of parameters\n";
}

int main(int argc, char** argv) {
  auto world = comm::init_from_env();
  mesh::DeviceMesh mesh(world, mesh::MeshLayout(world->size(), mesh::MeshDims().dp(2).pp(2).tp(2)));
  const mesh::Coord me = mesh.coord();
  torch::manual_seed(0);  // every rank builds the same model
  torch::nn::Sequential model{Embed()};
  for (int i = 0; i < kBlocks; ++i) model->push_back(Block());
  model->push_back(Head());
  const bool last_stage_prints = me.pp == 1 && me.tp == 0 && me.dp == 0;  // pp rank 1 holds the last stage

  if (argc > 1 && std::string(argv[1]) == "--trainer") {
    train::Trainer trainer(model, mesh, loss, make_adamw, train::TrainerOptions().zero(3).tp_plan(tp_plan())
                               .pipeline(pp::PipelineOptions().microbatches(4)).clip_grad_norm(1.0));
    train_steps(me, last_stage_prints, [&](torch::Tensor x, torch::Tensor y) { return trainer.step(x, y); });
    report(*world, me, zero::full_parameters(*trainer.module()), *trainer.module());  // gathered: every rank calls it
    return 0;
  }
  tp::parallelize(*model, mesh.tp(), tp_plan());
  auto stage = pp::pipeline(model, mesh.pp(), loss, pp::PipelineOptions().microbatches(4));
  for (const auto& layer : stage->children()) zero::fully_shard(*layer, mesh.dp());
  torch::optim::AdamW adam(stage->parameters(), torch::optim::AdamWOptions(3e-3).weight_decay(0));
  train_steps(me, last_stage_prints, [&](torch::Tensor x, torch::Tensor y) {
    adam.zero_grad();
    const double batch_loss = stage.step(x, y);
    adam.step();
    return batch_loss;
  });
  report(*world, me, zero::full_parameters(*stage.module()), *stage.module());  // gathered: every rank calls it
}
