#include "app/trainer/device_peak.h"

#include <ATen/ATen.h>

#include <cstdio>
#include <cstdlib>
#include <set>

#include "comm/process.h"
#include "meshtrain/util.h"
#include "train/matmul_rate.h"
#include "util/flags.h"
#include "util/strings.h"

namespace meshtrain {
namespace train {

// Note [An honest MFU]
// MFU is the model's FLOPs per second over the devices' peak, as llm.c and
// torchtitan report it. Until this note it was over a 256^3 float32 product
// timed at start, which runs at about half a 2048^3 product's speed on these
// CPUs: GPT-2 124M showed "MFU 87-95%" where the honest figure is ~50%, and
// the figure was never shown. Now the peak is --peak-tflops (per host: a
// CPU's cores or a node's accelerators, as their datasheet gives it) times
// the hosts, or, by default, measured at the run's precision on products
// large enough for the kernels to reach their speed (train/matmul_rate.h),
// by every rank at once from a barrier: all their FLOPs over the slowest
// rank's time (ranks that share cores see their share, so this is the host's
// speed). The start line says which, with the CPU,
// and the metrics file records the peak, how it was obtained and the model's
// FLOPs per step.
//
// Note [bf16 where it helps]
// A CPU without bf16 instructions (AVX512_BF16, AMX) runs bf16 products 30-40x
// slower than float32 ones (GPT-2 124M: ~47 s a step against 2.9 s). So under
// bf16-mixed both rates are measured and, when bf16's is the lower, rank 0
// warns with both figures and the fix.

namespace {

int count_hosts(comm::Communicator& metrics) {
  const std::vector<std::string> hosts = comm::all_gather_strings(metrics, comm::host_identity());
  return static_cast<int>(std::set<std::string>(hosts.begin(), hosts.end()).size());
}

// The ranks' rate together: each times products of the size matmul_size_for
// chooses (at least 2, for at least 0.1 s), all starting at a barrier, and the
// job's rate is all their FLOPs over the slowest rank's time. (Summing each
// rank's best time would count the moments a rank ran alone on a shared core:
// 8 ranks on 2 cores summed to more than the two cores can do.) About 0.2 s
// at start, one process or 8 ranks on 2 cores.
std::pair<double, int64_t> together_rate(at::ScalarType dtype, comm::Communicator& metrics) {
  const int64_t n = matmul_size_for(dtype);
  const auto [seconds, products] = time_matmuls(dtype, n, 2, 0.1, [&] { metrics.barrier(); });
  at::Tensor work = at::tensor({2.0 * static_cast<double>(n) * n * n * products}, at::kDouble);
  at::Tensor slowest = at::tensor({seconds}, at::kDouble);
  metrics.all_reduce(work);
  metrics.all_reduce(slowest, comm::ReduceOp::kMax);
  return {work.item<double>() / slowest.item<double>(), n};
}

}  // namespace

JobPeak job_peak(const TrainConfig& c, comm::Communicator& metrics) {
  const bool bf16 = c.precision == "bf16-mixed";
  JobPeak peak;
  if (bf16) peak.fp32_flops = together_rate(at::kFloat, metrics).first;  // for the warning
  const char* env = std::getenv("MESHTRAIN_PEAK_TFLOPS");
  const double given = c.peak_tflops > 0 ? c.peak_tflops : env ? flags::to_finite("MESHTRAIN_PEAK_TFLOPS", env) : 0;
  if (given > 0) {
    const int hosts = count_hosts(metrics);
    peak.flops = given * 1e12 * hosts;
    peak.how = str_cat(c.peak_tflops > 0 ? "--peak-tflops " : "MESHTRAIN_PEAK_TFLOPS=", given, " x ", hosts,
                       hosts == 1 ? " host" : " hosts");
    if (bf16) peak.bf16_flops = together_rate(at::kBFloat16, metrics).first;
    return peak;
  }
  const auto [rate, n] = together_rate(bf16 ? at::kBFloat16 : at::kFloat, metrics);
  (bf16 ? peak.bf16_flops : peak.fp32_flops) = rate;
  peak.flops = rate;
  const std::string cpu = cpu_model_name();
  peak.how = str_cat("measured: ", n, "^3 ", bf16 ? "bfloat16" : "float32", " matmuls for 0.1 s on each of ",
                     metrics.size(), metrics.size() == 1 ? " rank" : " ranks", " at once", cpu.empty() ? "" : " on " + cpu);
  return peak;
}

void print_peak(const TrainConfig& c, const JobPeak& peak) {
  std::printf("peak %.3g TFLOP/s (%s): MFU is the model's FLOP/s over it\n", peak.flops / 1e12, peak.how.c_str());
  if (c.precision == "bf16-mixed" && peak.bf16_flops > 0 && peak.bf16_flops < peak.fp32_flops) {
    std::printf("warning: --precision bf16-mixed: bf16 matrix products run at %.3g GFLOP/s here against float32's "
                "%.3g GFLOP/s (%.1fx slower: this CPU lacks bf16 instructions); --precision fp32 trains faster "
                "(Note [bf16 where it helps])\n",
                peak.bf16_flops / 1e9, peak.fp32_flops / 1e9, peak.fp32_flops / peak.bf16_flops);
  }
}

}  // namespace train
}  // namespace meshtrain
