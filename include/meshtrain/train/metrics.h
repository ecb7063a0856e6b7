#pragma once
// What the trainer measures and reports: memory held per rank, peak RSS,
// traffic per step, and the loss curve (terminal plot, SVG).

#include <string>
#include <vector>

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
// A small plot of the values for a terminal.
std::string ascii_plot(const std::vector<double>& values, int width = 60, int height = 10);
// The loss curve as an SVG file.
void write_svg_plot(const std::string& path, const std::vector<double>& values, const std::string& title);

}  // namespace train
}  // namespace meshtrain
