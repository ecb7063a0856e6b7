// What tp::parallelize's dispatcher route costs: the same MLP block trained
// with plain Linear layers under tp::parallelize, and written by hand as
// Megatron's MLP (slices of the same dense weights, tp's conjugate autograd
// functions copy_to_tp / reduce_from_tp around the products: what the
// explicit parallel layers did before they were removed), interleaved in one
// run.
//   meshrun --nproc-per-node 2 -- build/bin/bench_tp_parallelize [hidden] [batch] [steps]
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>

#include "meshtrain/comm.h"
#include "meshtrain/tp.h"

using namespace meshtrain;

struct Plain : torch::nn::Module {
  Plain(int64_t h) : fc1(register_module("fc1", torch::nn::Linear(h, 4 * h))), fc2(register_module("fc2", torch::nn::Linear(4 * h, h))) {}
  torch::Tensor forward(const torch::Tensor& x) { return fc2(torch::gelu(fc1(x))); }
  torch::nn::Linear fc1, fc2;
};

// fc1 keeps rows [r F/tp, (r+1) F/tp) of its weight and bias, fc2 the same
// columns of its weight and its whole bias (added once, after the sum).
struct HandWritten : torch::nn::Module {
  HandWritten(const Plain& dense, const comm::CommPtr& tp) : tp_(tp) {
    const int64_t part = dense.fc1->weight.size(0) / tp->size(), first = part * tp->rank();
    w1 = register_parameter("w1", dense.fc1->weight.detach().narrow(0, first, part).clone());
    b1 = register_parameter("b1", dense.fc1->bias.detach().narrow(0, first, part).clone());
    w2 = register_parameter("w2", dense.fc2->weight.detach().narrow(1, first, part).clone());
    b2 = register_parameter("b2", dense.fc2->bias.detach().clone());
  }
  torch::Tensor forward(const torch::Tensor& x) {
    const torch::Tensor h = torch::gelu(torch::linear(tp::copy_to_tp(x, tp_), w1, b1));
    return tp::reduce_from_tp(torch::linear(h, w2), tp_) + b2;
  }
  comm::CommPtr tp_;
  torch::Tensor w1, b1, w2, b2;
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
  auto hand_written = std::make_shared<HandWritten>(*dense, world);
  tp::parallelize(*dense, world, {{"fc1", tp::Style::kColwise}, {"fc2", tp::Style::kRowwise}});
  torch::optim::SGD opt_plain(dense->parameters(), 1e-3), opt_hand(hand_written->parameters(), 1e-3);
  auto x = torch::randn({batch, hidden}, torch::requires_grad());  // the input's gradient is computed too
  std::vector<double> plain, expl;
  for (int s = 0; s < steps + 3; ++s) {  // interleaved; the first 3 of each are warm-up
    const double a = step_seconds(*dense, opt_plain, x, *world), b = step_seconds(*hand_written, opt_hand, x, *world);
    if (s >= 3) plain.push_back(a), expl.push_back(b);
  }
  if (world->rank() == 0) {
    std::printf("tp %d, MLP %lld -> %lld -> %lld, batch %lld, %d steps (median)\n", world->size(), (long long)hidden,
                (long long)(4 * hidden), (long long)hidden, (long long)batch, steps);
    std::printf("tp::parallelize on plain Linear: %.3f ms/step\nhand-written (tp ops):           %.3f ms/step\nratio: %.3f\n",
                1e3 * median(plain), 1e3 * median(expl), median(plain) / median(expl));
  }
}
