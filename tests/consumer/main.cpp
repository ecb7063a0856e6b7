// A user's program against the installed meshtrain: its own model trained on
// 2 ranks with DDP (dp::replicate) and as a 2-stage pipeline (pp::pipeline),
// each run's losses checked against the same model trained in this process
// alone.   meshrun --nproc-per-node 2 -- ./consumer
#include <meshtrain/meshtrain.h>  // the umbrella: every installed header compiles from the installed tree
#include <torch/torch.h>

#include <cmath>
#include <iostream>

using namespace meshtrain;

constexpr int kSteps = 5;

torch::nn::Sequential make_model() {
  torch::manual_seed(1);  // every rank, and the reference, start from the same values
  return torch::nn::Sequential(torch::nn::Linear(4, 16), torch::nn::Tanh(), torch::nn::Linear(16, 8), torch::nn::Tanh(),
                               torch::nn::Linear(8, 1));
}

std::pair<torch::Tensor, torch::Tensor> batch(int step) {
  torch::manual_seed(10 + step);
  auto x = torch::randn({8, 4});
  return {x, x.sum(1, /*keepdim=*/true).sin()};
}

std::vector<double> alone() {
  auto model = make_model();
  torch::optim::SGD opt(model->parameters(), 0.1);
  std::vector<double> losses;
  for (int step = 0; step < kSteps; ++step) {
    auto [x, y] = batch(step);
    opt.zero_grad();
    auto loss = torch::mse_loss(model->forward(x), y);
    loss.backward();
    opt.step();
    losses.push_back(loss.item<double>());
  }
  return losses;
}

int main() {
  auto world = comm::init_from_env();
  const std::vector<double> reference = alone();
  double worst = 0;
  auto compare = [&](double got, int step) { worst = std::max(worst, std::abs(got - reference[step]) / (1 + reference[step])); };

  auto ddp = dp::replicate(make_model().ptr(), world);  // each rank half of every batch
  torch::optim::SGD ddp_opt(ddp->parameters(), 0.1);
  for (int step = 0; step < kSteps; ++step) {
    auto [x, y] = batch(step);
    ddp_opt.zero_grad();
    auto loss = torch::mse_loss(ddp->forward(x.chunk(2)[world->rank()]), y.chunk(2)[world->rank()]);
    loss.backward();
    ddp_opt.step();
    auto mean = loss.detach().reshape({1});
    world->all_reduce(mean, comm::ReduceOp::kAvg);
    compare(mean.item<double>(), step);
  }

  auto mse = [](const torch::Tensor& out, const torch::Tensor& target) { return torch::mse_loss(out, target); };
  auto stage = pp::pipeline(make_model(), world, mse, pp::PipelineOptions().microbatches(2));
  torch::optim::SGD pp_opt(stage->parameters(), 0.1);
  for (int step = 0; step < kSteps; ++step) {
    auto [x, y] = batch(step);
    pp_opt.zero_grad();
    compare(stage.step(x, y), step);
    pp_opt.step();
  }

  const bool ok = worst < 1e-5;
  if (world->rank() == 0) {
    std::cout << "consumer (meshtrain " << version() << "): DDP and a 2-stage pipeline on 2 ranks "
              << (ok ? "match" : "DO NOT match") << " one process (worst relative loss difference " << worst << ")"
              << std::endl;
  }
  return ok ? 0 : 1;
}
