// The article's master DP engine (everything else runs on the mesh engine), and
// the engine and dataset factories.

#include <ATen/ATen.h>

#include <optional>

#include "engine.h"
#include "meshtrain/dp.h"
#include "meshtrain/models.h"
#include "meshtrain/train.h"
#include "train/mixed_precision.h"
#include "app/trainer/optimizer.h"
#include "train/optim.h"
#include "meshtrain/util.h"
#include "zero/optimizer_state.h"

namespace meshtrain {
namespace train {

namespace {

std::vector<at::Tensor> tensors_of(const std::vector<dp::NamedParam>& params) {
  std::vector<at::Tensor> out;
  for (const auto& p : params) out.push_back(p.tensor);
  return out;
}

int64_t grad_bytes(const std::vector<dp::NamedParam>& params) {
  int64_t n = 0;
  for (const auto& p : params)
    if (p.tensor.grad().defined()) n += p.tensor.grad().nbytes();
  return n;
}

std::map<std::string, at::Tensor> clone_all(const std::vector<dp::NamedParam>& params) {
  std::map<std::string, at::Tensor> out;
  for (const auto& p : params) out[p.name] = p.tensor.detach().clone();
  return out;
}

class MasterDpEngine : public Engine {
 public:
  MasterDpEngine(const TrainConfig& c, comm::CommPtr comm)
      : c_(c), comm_(std::move(comm)), data_(make_dataset(c)) {
    const StartingWeights weights(c);
    model_ = models::build_stage(c.model, 0, models::num_pieces(c.model), weights.context());
    models::apply_checkpointing(*model_, c.model, c.activation_checkpointing, 0);
    const bool root = comm_->rank() == 0;
    mixed_ = c.precision == "bf16-mixed";
    // bf16-mixed: the master keeps float32 masters; every rank computes in bf16.
    if (mixed_ && root) masters_.emplace(*model_);
    if (mixed_ && !root) cast_parameters(*model_, at::kBFloat16);
    mdp_ = std::make_unique<dp::MasterDataParallel>(model_.ptr(), comm_, [this](const at::Tensor& y, const at::Tensor& t) {
      return models::loss(c_.model, y.to(at::kFloat), t) * scale_;
    });
    params_ = dp::unique_parameters(*model_);
    stepped_ = masters_ ? masters_->masters() : params_;
    if (root) optimizer_ = make_optimizer(c, tensors_of(stepped_));  // only the master steps
  }

  double step(int64_t step) override {
    // Rank 0 reads the global batch in chunks of dp x micro-batch samples.
    const int64_t chunk = c_.dp * c_.micro_batch, chunks = c_.global_batch / chunk;
    const bool root = comm_->rank() == 0;
    if (root) optimizer_->zero_grad();
    if (masters_) masters_->zero_model_grad();
    scale_ = static_cast<double>(chunk) / c_.global_batch;
    double loss = 0;
    for (int64_t j = 0; j < chunks; ++j) {
      Batch b = root ? data_->samples(step * c_.global_batch + j * chunk, chunk) : Batch{};
      at::Tensor l = mdp_->step(b.inputs, b.targets, [this](const at::Tensor& x) {
        return model_->forward(mixed_ && x.is_floating_point() ? x.to(at::kBFloat16) : x);
      });
      if (root) loss += l.item<double>();
    }
    // Only the master holds gradients (the sum of every worker's).
    if (masters_) masters_->gradients_to_masters();
    std::vector<GradPart> parts;
    if (root)
      for (const auto& p : stepped_) parts.push_back({p.tensor.grad(), true});
    grad_norm_ = clip_grad_norm(parts, c_.clip_grad_norm, *comm_);
    if (root) optimizer_->step();
    if (masters_) masters_->masters_to_parameters();
    return loss;  // the trainer sums: only rank 0 contributes
  }

  std::map<std::string, at::Tensor> full_parameters() override {
    return comm_->rank() == 0 ? clone_all(stepped_) : std::map<std::string, at::Tensor>{};
  }

  // The master holds the model it steps: it evaluates alone, in the chunks
  // it reads training batches in.
  double evaluate(const Dataset& data, int64_t first, int64_t count) override {
    if (comm_->rank() != 0) return 0.0;
    at::NoGradGuard no_grad;
    const int64_t chunk = c_.dp * c_.micro_batch, chunks = count / chunk;
    double loss = 0;
    for (int64_t j = 0; j < chunks; ++j) {
      const Batch b = data.samples(first + j * chunk, chunk);
      const at::Tensor x = mixed_ && b.inputs.is_floating_point() ? b.inputs.to(at::kBFloat16) : b.inputs;
      loss += models::loss(c_.model, model_->forward(x).to(at::kFloat), b.targets).item<double>() / chunks;
    }
    return loss;
  }

  double last_grad_norm() const override { return grad_norm_; }

  void set_learning_rate(double lr) override {
    if (optimizer_) train::set_learning_rate(*optimizer_, lr);
  }

  StateBytes state_bytes() const override {
    StateBytes s;
    s.parameters = dp::total_bytes(tensors_of(params_));
    s.gradients = grad_bytes(params_);
    s.optimizer = (optimizer_ ? optimizer_state_bytes(*optimizer_) : 0) + (masters_ ? masters_->master_bytes() : 0);
    return s;
  }

  comm::Traffic traffic() const override { return comm_->traffic(); }
  void reset_traffic() override { comm_->reset_traffic(); }

  // Rank 0 holds the state that matters (its parameters are replicated every step).
  RankState checkpoint_state() override {
    RankState out;
    if (comm_->rank() != 0) return out;
    for (const auto& p : stepped_) {
      out.chunks.push_back({p.name, "value", p.tensor.sizes().vec(), -1, 0, 1, 0, p.tensor.detach().reshape({-1})});
      for (const auto& kv : zero::state_of(*optimizer_, p.tensor)) {
        if (kv.first == "step") out.steps[p.name] = kv.second.item<int64_t>();
        else out.chunks.push_back({p.name, kv.first, p.tensor.sizes().vec(), -1, 0, 1, 0, kv.second.reshape({-1})});
      }
    }
    return out;
  }
  void load_checkpoint(CheckpointReader& reader) override {
    at::NoGradGuard no_grad;
    for (auto& p : stepped_) {
      MESHTRAIN_CHECK(reader.has(p.name), "checkpoint has no parameter '", p.name, "'");
      p.tensor.copy_(reader.full(p.name, "value").view_as(p.tensor));
      if (!optimizer_) continue;
      std::map<std::string, at::Tensor> state;
      for (const char* kind : {"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer"}) {
        at::Tensor t = reader.full(p.name, kind);
        if (t.defined()) state[kind] = t.view_as(p.tensor);
      }
      if (auto step = reader.optimizer_step(p.name)) state["step"] = at::scalar_tensor(*step, at::kLong);
      zero::set_state(*optimizer_, p.tensor, state);
    }
    if (masters_) masters_->masters_to_parameters();
  }

 private:
  TrainConfig c_;
  comm::CommPtr comm_;
  std::unique_ptr<Dataset> data_;
  models::Stage model_{nullptr};
  std::unique_ptr<dp::MasterDataParallel> mdp_;
  std::vector<dp::NamedParam> params_;   // the module's (bf16 under bf16-mixed)
  std::optional<MasterWeights> masters_;  // bf16-mixed, on the master only
  std::vector<dp::NamedParam> stepped_;  // what the optimizer steps and checkpoints hold
  bool mixed_ = false;
  std::unique_ptr<torch::optim::Optimizer> optimizer_;
  double scale_ = 1.0;
  double grad_norm_ = 0;
};

}  // namespace

StartingWeights::StartingWeights(const TrainConfig& c) {
  if (!c.init_from.empty()) loaded_ = std::make_unique<io::LoadedWeights>(io::load_weights(c.init_from));
}

models::BuildContext StartingWeights::context(models::BuildContext ctx) const {
  if (loaded_) ctx.weights = &loaded_->tensors;
  return ctx;
}

std::unique_ptr<Dataset> make_dataset(const TrainConfig& c) {
  if (!c.data.empty()) {
    if (data_is_token_shards(c.data)) {
      return make_token_shard_dataset(expand_data_paths(c.data), c.model.seq_len,
                                      WindowOrder().shuffle(c.shuffle).seed(c.seed).vocab(c.model.vocab));
    }
    return make_text_dataset(c.data, c.seed, c.model.seq_len);
  }
  if (models::is_language_model(c.model)) return make_arithmetic_dataset(c.seed, c.model.seq_len, c.digits);
  return make_classification_dataset(c.seed, c.model.features, c.model.classes);
}

std::unique_ptr<Engine> make_engine(const TrainConfig& c, comm::CommPtr world) {
  if (c.strategy == "dp") return std::make_unique<MasterDpEngine>(c, world);
  return make_mesh_engine(c, world);
}

}  // namespace train
}  // namespace meshtrain
