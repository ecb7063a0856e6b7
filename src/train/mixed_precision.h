#pragma once
// bf16 mixed precision (Micikevicius et al. 2018; the ZeRO paper's 2 + 2 + 12
// bytes per parameter with Adam) for a module trained whole on each rank:
// plain or DDP, on any pipeline stage and tensor-parallel slice.
//
//   train::MasterWeights masters(*model);     // fp32 copies; the model becomes bf16
//   torch::optim::AdamW opt(masters.parameters(), ...);   // steps float32
//   ... forward and backward in bf16 (DDP reduces bf16 gradients) ...
//   masters.gradients_to_masters();           // master.grad = float32(param.grad)
//   opt.step();
//   masters.masters_to_parameters();          // param = bf16(master)
//
// The optimizer state and the master weights are float32 (12 bytes per
// parameter with Adam), the module's parameters and gradients bf16 (2 + 2).
// bf16 keeps float32's exponent range, so small gradients do not underflow and
// no loss scaling is needed (fp16 would need it). Gradients accumulated over
// micro-batches add in bf16 (8 bits of mantissa); the reduction over ranks adds
// in bf16 or, with DistributedDataParallelOptions::reduce_dtype(at::kFloat),
// in float32.

#include <torch/nn/module.h>

#include <vector>

#include "meshtrain/dp.h"

namespace meshtrain {
namespace train {

// Note [bf16 products on hosts without AVX-512]
// Whether this host's libtorch multiplies bf16 matrices accumulating in
// float32. libtorch 1.13 sends CPU bf16 matrix products to oneDNN only where
// the CPU has AVX-512; elsewhere its own gemm accumulates in bf16, so a
// product's error grows with its inner dimension (measured on an AVX2 host:
// relative error 0.5% at K = 16, 2.2% at 384, 7.5% at 4096, where float
// accumulation leaves bf16's one rounding, ~0.3%). A weight's gradient sums
// over every token of the micro-batch, so bf16-mixed training then depends on
// the micro-batch size: the same global batch in micro-batches of 12 or of 24
// gave gradient norms 5% apart after one step. The probe: a product of
// 2 x 4096 and 4096 x 2 matrices of ones, both contiguous (with the second
// transposed, libtorch's loop happens to add in float): every entry exactly
// 4096 with float accumulation, 256 in bf16 (256 + 1 rounds to 256).
// Measured once per process.
bool bf16_products_accumulate_in_float();

// Casts the module's floating-point parameters to `dtype` in place (a rank
// that computes in bf16 but keeps no masters).
void cast_parameters(torch::nn::Module& module, at::ScalarType dtype);

class MasterWeights {
 public:
  // Copies the module's parameters to float32 masters, then casts the
  // parameters to `compute` in place (tied parameters stay tied).
  explicit MasterWeights(torch::nn::Module& module, at::ScalarType compute = at::kBFloat16);
  // The float32 masters under the module's parameter names: what the optimizer
  // steps and what checkpoints hold.
  const std::vector<dp::NamedParam>& masters() const { return masters_; }
  std::vector<at::Tensor> parameters() const;
  // After the step's last backward: float32 copies of the gradients, which
  // live only until masters_to_parameters (the step), as in the paper's count.
  void gradients_to_masters();
  void masters_to_parameters();  // after the optimizer step (or loading the masters)
  void zero_model_grad();        // the module's gradients (the optimizer zeroes the masters')
  int64_t master_bytes() const;

 private:
  std::vector<dp::NamedParam> model_, masters_;
};

}  // namespace train
}  // namespace meshtrain
