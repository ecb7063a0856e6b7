// What tp::parallelize's dispatcher route costs: the same MLP block trained
// with plain Linear layers under tp::parallelize, and with meshtrain's
// explicit parallel layers built from the same dense layers (autograd
// functions around the all-reduces), interleaved in one run.
//   meshrun --nproc-per-node 2 -- build/bin/bench_tp_parallelize [hidden] [batch] [steps]
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>

#include "meshtrain/comm/rendezvous.h"
#include "meshtrain/tp/layers.h"
#include "meshtrain/tp/parallelize.h"

using namespace meshtrain;

struct Plain : torch::nn::Module {
  Plain(int64_t h) : fc1(register_module("fc1", torch::nn::Linear(h, 4 * h))), fc2(register_module("fc2", torch::nn::Linear(4 * h, h))) {}
  torch::Tensor forward(const torch::Tensor& x) { return fc2(torch::gelu(fc1(x))); }
  torch::nn::Linear fc1, fc2;
};

struct Explicit : torch::nn::Module {
  Explicit(const Plain& dense, const comm::CommPtr& tp)
      : fc1(register_module("fc1", tp::column_parallel(dense.fc1, tp))), fc2(register_module("fc2", tp::row_parallel(dense.fc2, tp))) {}
  torch::Tensor forward(const torch::Tensor& x) { return fc2(torch::gelu(fc1(x))); }
  tp::ColumnParallelLinear fc1;
  tp::RowParallelLinear fc2;
};

template <typename M>
double step_seconds(M& model, torch::optim::Optimizer& opt, const torch::Tensor& x, comm::Communicator& world) {
  world.barrier();
  const auto t0 = std::chrono::steady_clock::now();
  opt.zero_grad();
  model.forward(x).pow(2).mean().backward();
  opt.step();
  world.barrier();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int main(int argc, char** argv) {
  auto world = comm::init_from_env();
  const int64_t hidden = argc > 1 ? std::atoll(argv[1]) : 256, batch = argc > 2 ? std::atoll(argv[2]) : 64;
  const int steps = argc > 3 ? std::atoi(argv[3]) : 50;
  torch::manual_seed(0);
  auto dense = std::make_shared<Plain>(hidden);
  auto explicit_layers = std::make_shared<Explicit>(*dense, world);
  tp::parallelize(*dense, world, {{"fc1", tp::Style::kColwise}, {"fc2", tp::Style::kRowwise}});
  torch::optim::SGD opt_plain(dense->parameters(), 1e-3), opt_explicit(explicit_layers->parameters(), 1e-3);
  auto x = torch::randn({batch, hidden}, torch::requires_grad());  // the input's gradient is computed too
  std::vector<double> plain, expl;
  for (int s = 0; s < steps + 3; ++s) {  // interleaved; the first 3 of each are warm-up
    const double a = step_seconds(*dense, opt_plain, x, *world), b = step_seconds(*explicit_layers, opt_explicit, x, *world);
    if (s >= 3) plain.push_back(a), expl.push_back(b);
  }
  if (world->rank() == 0) {
    std::printf("tp %d, MLP %lld -> %lld -> %lld, batch %lld, %d steps (median)\n", world->size(), (long long)hidden,
                (long long)(4 * hidden), (long long)hidden, (long long)batch, steps);
    std::printf("tp::parallelize on plain Linear: %.3f ms/step\nexplicit parallel layers:        %.3f ms/step\nratio: %.3f\n",
                1e3 * median(plain), 1e3 * median(expl), median(plain) / median(expl));
  }
}
