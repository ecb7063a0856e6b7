// DDP step time of meshtrain on the peer benchmark's models (run under meshrun;
// with one rank it trains without DDP: the single-process baseline).
//   mlp: 4 x Linear(1024, 1024) with ReLU, MSE against a random target, SGD
//        (the same model, loss and optimizer as bench/ddp/torch_ddp.py)
//   gpt: the built-in GPT, vocab 512, hidden 256, 4 layers, 4 heads, seq 128, AdamW
// Per rank: --batch samples per step. Prints and writes one JSON object:
// mean step time over the timed steps (max over ranks).
#include <torch/torch.h>

#include <chrono>
#include <fstream>
#include <iostream>

#include "meshtrain/comm.h"
#include "meshtrain/dp.h"
#include "meshtrain/models.h"

using namespace meshtrain;
using Clock = std::chrono::steady_clock;

int main(int argc, char** argv) {
  std::string model_kind = "mlp", out;
  int64_t batch = 64;
  int steps = 20, warmup = 3;
  bool overlap = true;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string f = argv[i], v = argv[i + 1];
    if (f == "--model") model_kind = v;
    else if (f == "--batch") batch = std::stoll(v);
    else if (f == "--steps") steps = std::stoi(v);
    else if (f == "--warmup") warmup = std::stoi(v);
    else if (f == "--overlap") overlap = v == "1";
    else if (f == "--out") out = v;
  }
  auto world = comm::init_from_env();
  torch::manual_seed(0);
  std::shared_ptr<torch::nn::Module> model;
  std::function<torch::Tensor()> loss_fn;
  torch::manual_seed(100 + world->rank());
  if (model_kind == "mlp") {
    auto seq = torch::nn::Sequential();
    for (int l = 0; l < 4; ++l) {
      seq->push_back(torch::nn::Linear(1024, 1024));
      if (l != 3) seq->push_back(torch::nn::ReLU());
    }
    model = seq.ptr();
    auto x = torch::randn({batch, 1024}), y = torch::randn({batch, 1024});
    loss_fn = [seq, x, y]() mutable { return torch::mse_loss(seq->forward(x), y); };
  } else {
    models::ModelConfig c;
    c.vocab = 512, c.hidden = 256, c.layers = 4, c.heads = 4, c.seq_len = 128, c.tie_embeddings = false;
    auto stage = models::build_stage(c, 0, models::num_pieces(c));
    model = stage.ptr();
    auto tokens = torch::randint(0, 512, {batch, 129}, torch::kLong);
    auto x = tokens.narrow(1, 0, 128).contiguous(), y = tokens.narrow(1, 1, 128).contiguous();
    loss_fn = [stage, c, x, y]() mutable { return models::loss(c, stage->forward(x), y); };
  }
  std::unique_ptr<dp::DistributedDataParallel> ddp;
  if (world->size() > 1) {
    ddp = std::make_unique<dp::DistributedDataParallel>(model, world, dp::DistributedDataParallelOptions().overlap(overlap));
  }
  std::unique_ptr<torch::optim::Optimizer> opt;
  if (model_kind == "mlp") opt = std::make_unique<torch::optim::SGD>(model->parameters(), torch::optim::SGDOptions(0.01));
  else opt = std::make_unique<torch::optim::AdamW>(model->parameters(), torch::optim::AdamWOptions(1e-3));
  auto step = [&] {
    opt->zero_grad();
    torch::Tensor loss = ddp ? ddp->forward(loss_fn) : loss_fn();
    loss.backward();
    opt->step();
  };
  for (int i = 0; i < warmup; ++i) step();
  world->barrier();
  const auto t0 = Clock::now();
  for (int i = 0; i < steps; ++i) step();
  auto t = torch::tensor({std::chrono::duration<double>(Clock::now() - t0).count() / steps}, torch::kDouble);
  world->all_reduce(t, comm::ReduceOp::kMax);
  const double sec = t.item<double>();
  if (world->rank() == 0) {
    const std::string json = "{\"impl\": \"meshtrain\", \"model\": \"" + model_kind + "\", \"world_size\": " +
                             std::to_string(world->size()) + ", \"overlap\": " + (overlap ? "true" : "false") +
                             ", \"batch_per_rank\": " + std::to_string(batch) + ", \"step_time_s\": " + std::to_string(sec) +
                             ", \"samples_per_s\": " + std::to_string(batch * world->size() / sec) + "}";
    std::cout << json << std::endl;
    if (!out.empty()) std::ofstream(out) << json << "\n";
  }
}
