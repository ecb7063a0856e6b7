// The engine for ZeRO stages 1-3 on the data axis.

#include <ATen/ATen.h>

#include <optional>

#include "engine.h"
#include "meshtrain/dp/params.h"
#include "meshtrain/models/models.h"
#include "meshtrain/train/optim.h"
#include "meshtrain/zero/zero.h"

namespace meshtrain {
namespace train {

namespace {

class ZeroEngine : public Engine {
 public:
  ZeroEngine(const TrainConfig& c, comm::CommPtr comm) : c_(c), comm_(std::move(comm)), data_(make_dataset(c)) {
    model_ = models::build_stage(c.model, 0, models::num_pieces(c.model));
    std::vector<at::Tensor> params;
    for (const auto& p : dp::unique_parameters(*model_)) params.push_back(p.tensor);
    auto optimizer = make_optimizer(c, params);
    if (c.zero < 3) {
      zro_ = std::make_unique<zero::ZeroRedundancyOptimizer>(
          model_.ptr(), std::move(optimizer), comm_,
          zero::ZeroOptions().stage(c.zero).bucket_cap_mb(c.bucket_cap_mb).overlap(c.overlap));
    } else {
      // One unit per piece (embedding, each block, head). A tied LM head uses
      // the embedding's weight, so the embedding stays gathered for the step.
      std::vector<std::shared_ptr<torch::nn::Module>> units;
      for (size_t i = 0; i < model_->num_pieces(); ++i) units.push_back(model_->piece(i));
      zero::FsdpOptions options;
      if (c.model.kind == "gpt" && c.model.tie_embeddings) options.keep_gathered({0});
      fsdp_ = std::make_unique<zero::FullyShardedDataParallel>(model_.ptr(), units, std::move(optimizer), comm_, options);
    }
  }

  at::Tensor forward(const at::Tensor& x) {
    if (!fsdp_) return model_->forward(x);
    at::Tensor h = x;
    for (size_t i = 0; i < model_->num_pieces(); ++i) {
      h = fsdp_->run_unit(i, [&] { return model_->forward_range(h, i, i + 1); });
    }
    return h;
  }

  double step(int64_t step) override {
    const int64_t local = c_.global_batch / c_.dp, m = c_.micro_batch, accum = local / m;
    const int64_t first = step * c_.global_batch + comm_->rank() * local;
    zro_ ? zro_->zero_grad() : fsdp_->zero_grad();
    double contribution = 0;
    for (int64_t j = 0; j < accum; ++j) {
      Batch b = data_->samples(first + j * m, m);
      // Stage 1 reduces once per step; stages 2 and 3 keep only shards, so they
      // reduce every micro-batch (as DeepSpeed does).
      std::optional<zero::ZeroRedundancyOptimizer::NoSync> no_sync;
      if (c_.zero == 1 && j + 1 < accum) no_sync.emplace(zro_->no_sync());
      at::Tensor loss = models::loss(c_.model, forward(b.inputs), b.targets) * (static_cast<double>(m) / local);
      loss.backward();
      contribution += loss.item<double>() / c_.dp;
    }
    zro_ ? zro_->step() : fsdp_->step();
    return contribution;
  }

  std::map<std::string, at::Tensor> full_parameters() override {
    return (zro_ ? zro_->consolidated_state(0) : fsdp_->consolidated_state(0)).parameters;
  }

  StateBytes state_bytes() const override {
    const zero::HeldBytes h = zro_ ? zro_->held_bytes() : fsdp_->held_bytes();
    StateBytes s;
    s.parameters = h.parameters;
    s.gradients = h.gradients;
    s.optimizer = h.optimizer;
    s.buffers = h.buffers;
    return s;
  }

  comm::Traffic traffic() const override { return comm_->traffic(); }
  void reset_traffic() override { comm_->reset_traffic(); }

 private:
  TrainConfig c_;
  comm::CommPtr comm_;
  std::unique_ptr<Dataset> data_;
  models::Stage model_{nullptr};
  std::unique_ptr<zero::ZeroRedundancyOptimizer> zro_;
  std::unique_ptr<zero::FullyShardedDataParallel> fsdp_;
};

}  // namespace

std::unique_ptr<Engine> make_zero_engine(const TrainConfig& c, comm::CommPtr world) {
  return std::make_unique<ZeroEngine>(c, std::move(world));
}

}  // namespace train
}  // namespace meshtrain
