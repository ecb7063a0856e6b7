#include "chunk.h"

#include <ATen/ATen.h>

#include "meshtrain/dp/ddp.h"
#include "meshtrain/dp/params.h"
#include "meshtrain/train/optim.h"
#include "meshtrain/zero/zero.h"

namespace meshtrain {
namespace train {

namespace {

std::vector<at::Tensor> tensors(const models::Stage& stage) {
  std::vector<at::Tensor> out;
  for (const auto& p : dp::unique_parameters(*stage)) out.push_back(p.tensor);
  return out;
}

std::map<std::string, at::Tensor> clones(const models::Stage& stage) {
  std::map<std::string, at::Tensor> out;
  for (const auto& p : dp::unique_parameters(*stage)) out[p.name] = p.tensor.detach().clone();
  return out;
}

StateBytes local_bytes(const models::Stage& stage, const torch::optim::Optimizer& opt) {
  StateBytes s;
  for (const auto& p : dp::unique_parameters(*stage)) {
    s.parameters += p.tensor.nbytes();
    if (p.tensor.grad().defined()) s.gradients += p.tensor.grad().nbytes();
  }
  s.optimizer = optimizer_state_bytes(opt);
  return s;
}

class PlainChunk : public ChunkTrainer {
 public:
  PlainChunk(const TrainConfig& c, models::Stage stage) : ChunkTrainer(std::move(stage)), opt_(make_optimizer(c, tensors(stage_))) {}
  at::Tensor forward(const at::Tensor& x) override { return stage_->forward(x); }
  void zero_grad() override { opt_->zero_grad(); }
  void step() override { opt_->step(); }
  void begin_backward(bool) override {}
  void end_backward() override {}
  std::map<std::string, at::Tensor> parameters_on_dp_root() override { return clones(stage_); }
  StateBytes held() const override { return local_bytes(stage_, *opt_); }

 private:
  std::unique_ptr<torch::optim::Optimizer> opt_;
};

class DdpChunk : public ChunkTrainer {
 public:
  DdpChunk(const TrainConfig& c, models::Stage stage, comm::CommPtr dp)
      : ChunkTrainer(std::move(stage)), dp_(std::move(dp)) {
    ddp_ = std::make_unique<dp::DistributedDataParallel>(
        stage_.ptr(), dp_, dp::DistributedDataParallelOptions().bucket_cap_mb(c.bucket_cap_mb).overlap(c.overlap));
    opt_ = make_optimizer(c, tensors(stage_));
  }
  at::Tensor forward(const at::Tensor& x) override {
    return ddp_->forward([&] { return stage_->forward(x); });
  }
  void zero_grad() override { opt_->zero_grad(); }
  void step() override { opt_->step(); }
  void begin_backward(bool last) override {
    if (!last) no_sync_.emplace(ddp_->no_sync());  // communicate on the last micro-batch only
  }
  void end_backward() override { no_sync_.reset(); }
  std::map<std::string, at::Tensor> parameters_on_dp_root() override {
    return dp_->rank() == 0 ? clones(stage_) : std::map<std::string, at::Tensor>{};
  }
  StateBytes held() const override {
    StateBytes s = local_bytes(stage_, *opt_);
    s.buffers = s.parameters;  // DDP's buckets mirror the gradients
    return s;
  }

 private:
  comm::CommPtr dp_;
  std::unique_ptr<dp::DistributedDataParallel> ddp_;
  std::unique_ptr<torch::optim::Optimizer> opt_;
  std::optional<dp::DistributedDataParallel::NoSync> no_sync_;
};

class ZeroChunk : public ChunkTrainer {
 public:
  ZeroChunk(const TrainConfig& c, models::Stage stage, comm::CommPtr dp) : ChunkTrainer(std::move(stage)), stage_no_(c.zero) {
    zro_ = std::make_unique<zero::ZeroRedundancyOptimizer>(
        stage_.ptr(), make_optimizer(c, tensors(stage_)), std::move(dp),
        zero::ZeroOptions().stage(c.zero).bucket_cap_mb(c.bucket_cap_mb).overlap(c.overlap));
  }
  at::Tensor forward(const at::Tensor& x) override { return stage_->forward(x); }
  void zero_grad() override { zro_->zero_grad(); }
  void step() override { zro_->step(); }
  // Stage 1 reduces once per step; stage 2 keeps only its shard, so it reduces
  // every micro-batch (as DeepSpeed does).
  void begin_backward(bool last) override {
    if (!last && stage_no_ == 1) no_sync_.emplace(zro_->no_sync());
  }
  void end_backward() override { no_sync_.reset(); }
  std::map<std::string, at::Tensor> parameters_on_dp_root() override { return zro_->consolidated_state(0).parameters; }
  StateBytes held() const override {
    const zero::HeldBytes h = zro_->held_bytes();
    return StateBytes{h.parameters, h.gradients, h.optimizer, h.buffers};
  }

 private:
  int stage_no_;
  std::unique_ptr<zero::ZeroRedundancyOptimizer> zro_;
  std::optional<zero::ZeroRedundancyOptimizer::NoSync> no_sync_;
};

class FsdpChunk : public ChunkTrainer {
 public:
  FsdpChunk(const TrainConfig& c, models::Stage stage, comm::CommPtr dp, bool keep_first) : ChunkTrainer(std::move(stage)) {
    std::vector<std::shared_ptr<torch::nn::Module>> units;
    for (size_t i = 0; i < stage_->num_pieces(); ++i) units.push_back(stage_->piece(i));
    zero::FsdpOptions options;
    if (keep_first) options.keep_gathered({0});
    fsdp_ = std::make_unique<zero::FullyShardedDataParallel>(stage_.ptr(), units, make_optimizer(c, tensors(stage_)),
                                                             std::move(dp), options);
  }
  at::Tensor forward(const at::Tensor& x) override {
    at::Tensor h = x;
    for (size_t i = 0; i < stage_->num_pieces(); ++i) {
      h = fsdp_->run_unit(i, [&] { return stage_->forward_range(h, i, i + 1); });
    }
    return h;
  }
  void zero_grad() override { fsdp_->zero_grad(); }
  void step() override { fsdp_->step(); }
  void begin_backward(bool) override {}
  void end_backward() override {}
  std::map<std::string, at::Tensor> parameters_on_dp_root() override { return fsdp_->consolidated_state(0).parameters; }
  StateBytes held() const override {
    const zero::HeldBytes h = fsdp_->held_bytes();
    return StateBytes{h.parameters, h.gradients, h.optimizer, h.buffers};
  }

 private:
  std::unique_ptr<zero::FullyShardedDataParallel> fsdp_;
};

}  // namespace

std::unique_ptr<ChunkTrainer> make_chunk_trainer(const TrainConfig& c, models::Stage stage, comm::CommPtr dp,
                                                 bool keep_first_unit) {
  if (c.zero == 3) return std::make_unique<FsdpChunk>(c, std::move(stage), std::move(dp), keep_first_unit);
  if (c.zero > 0) return std::make_unique<ZeroChunk>(c, std::move(stage), std::move(dp));
  if (dp->size() == 1) return std::make_unique<PlainChunk>(c, std::move(stage));
  return std::make_unique<DdpChunk>(c, std::move(stage), std::move(dp));
}

}  // namespace train
}  // namespace meshtrain
