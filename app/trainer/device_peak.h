#pragma once
// The denominator of MFU, and whether bf16 pays on this host (Note [An honest
// MFU], Note [bf16 where it helps]).

#include <string>

#include "app/trainer/config.h"
#include "meshtrain/comm.h"

namespace meshtrain {
namespace train {

struct JobPeak {
  double flops = 0;  // the job's peak FLOP/s at the run's precision: the denominator of MFU
  std::string how;   // how it was obtained, for the start line and the metrics file
  // Measured float32 and bfloat16 rates of the ranks together (0: not measured).
  double fp32_flops = 0, bf16_flops = 0;
};

// Every rank of `metrics` calls it at once (the measurement runs on all
// ranks together, so ranks that share cores see their share).
JobPeak job_peak(const TrainConfig& c, comm::Communicator& metrics);

// The start-up lines: the peak and how it was obtained; under bf16-mixed, a
// warning with both rates when bf16 products are slower here than float32's.
void print_peak(const TrainConfig& c, const JobPeak& peak);

}  // namespace train
}  // namespace meshtrain
