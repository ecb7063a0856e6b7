#pragma once
// What the trainer measures and reports: memory held per rank, peak RSS,
// traffic per step, and the loss curve (terminal plot, SVG).

#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "meshtrain/comm/traffic.h"

namespace meshtrain {
namespace train {

// Bytes of training state this rank holds, from the tensors themselves.
struct StateBytes {
  int64_t parameters = 0;
  int64_t gradients = 0;
  int64_t optimizer = 0;
  int64_t buffers = 0;  // communication buffers (DDP buckets, gathered ZeRO units...)
  int64_t model_state() const { return parameters + gradients + optimizer; }
};

int64_t peak_rss_bytes();
// This process's float32 matrix-product speed (FLOP/s) with its intra-op
// threads, measured now on a 256^3 product: the denominator of model FLOPs
// utilisation, measured because these machines differ from host to host.
double measure_matmul_flops();
std::string state_bytes_json(const StateBytes& s);
// Traffic per step: the counters divided by the number of steps.
std::string traffic_json(const comm::Traffic& total, int steps);
// Mixtures of experts: a step's routes per layer and expert, [layers,
// experts + 1] (the last column: routes dropped for capacity).
// The busiest expert's routes over the mean, the largest over the layers: 1
// is perfect balance, experts / top_k every token on the same experts.
double router_imbalance(const at::Tensor& load);
// The routes of each layer's experts as JSON: [[e0, e1, ...], ...].
std::string router_load_json(const at::Tensor& load);
int64_t routes_dropped(const at::Tensor& load);
// A small plot of the values for a terminal.
std::string ascii_plot(const std::vector<double>& values, int width = 60, int height = 10);
// The loss curve as an SVG file.
void write_svg_plot(const std::string& path, const std::vector<double>& values, const std::string& title);

}  // namespace train
}  // namespace meshtrain
