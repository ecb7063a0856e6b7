#include "meshtrain/train/module_trainer.h"

#include <ATen/ATen.h>

#include <optional>
#include <set>

#include "meshtrain/dp/params.h"
#include "meshtrain/dp/replicate.h"
#include "meshtrain/tp/layers.h"
#include "meshtrain/train/clip.h"
#include "meshtrain/util/error.h"
#include "meshtrain/zero/fully_shard.h"

namespace meshtrain {
namespace train {

namespace {

std::vector<at::Tensor> trainable_once(const std::vector<std::shared_ptr<torch::nn::Module>>& modules) {
  std::vector<at::Tensor> out;
  std::set<const c10::TensorImpl*> seen;
  for (const auto& m : modules)
    for (const auto& p : dp::unique_parameters(*m))
      if (seen.insert(p.tensor.unsafeGetTensorImpl()).second) out.push_back(p.tensor);
  return out;
}

// The split a balanced pipeline would make of the whole, uncut model: the
// same on every tp rank (a vocabulary tp does not divide leaves the ranks'
// slices of unequal size, and so their own balanced splits could differ).
std::vector<int64_t> balanced_split(torch::nn::SequentialImpl& model, int stages) {
  if (static_cast<int64_t>(model.size()) < stages) return {};  // pp::pipeline says why
  const std::vector<int64_t> bounds = pp::partition_balanced(pp::parameter_counts(model), stages);
  return std::vector<int64_t>(bounds.begin() + 1, bounds.end() - 1);
}

// Children of this rank's chunks that share a parameter with another child
// (a head tied to the embedding on the same rank): they stay in one unit.
std::set<const torch::nn::Module*> sharing_children(const std::vector<std::shared_ptr<torch::nn::Module>>& units) {
  std::vector<std::pair<const torch::nn::Module*, at::Tensor>> owners;
  for (const auto& unit : units)
    for (const auto& child : unit->children())
      for (const auto& p : child->parameters()) owners.emplace_back(child.get(), p);
  std::set<const torch::nn::Module*> sharing;
  for (const auto& a : owners)
    for (const auto& b : owners)
      if (a.first != b.first && a.second.is_same(b.second)) sharing.insert(a.first);
  return sharing;
}

}  // namespace

struct Trainer::State {
  comm::CommPtr world, dp;
  mesh::Coord coord;
  double max_norm = 0, grad_norm = 0;
  int64_t microbatches = 1;
  int zero = 0;
  Loss loss;
  torch::nn::Sequential model;
  std::optional<pp::Pipeline> pipeline;
  std::shared_ptr<torch::nn::Module> root;
  std::vector<std::shared_ptr<torch::nn::Module>> units;  // each wrapped apart along dp
  std::vector<dp::Replicated<torch::nn::Module>> ddp;
  std::vector<std::unique_ptr<zero::ZeroRedundancyOptimizer>> zero12;
  std::unique_ptr<torch::optim::Optimizer> optimizer;  // zero 0 and 3

  void shard_fully() {
    const auto sharing = sharing_children(units);
    for (const auto& unit : units) {
      bool kept = false;
      for (const auto& child : unit->children()) {
        if (child->parameters().empty()) continue;
        if (sharing.count(child.get())) kept = true;
        else zero::fully_shard(*child, dp);
      }
      if (kept) zero::fully_shard(*unit, dp, zero::FullyShardOptions().reshard_after_forward(false));
    }
  }

  void wrap_data_axis(const MakeOptimizer& make_optimizer, zero::ZeroOptions zero_options) {
    if (zero == 3) shard_fully();
    for (const auto& unit : units) {
      if (zero == 0 && dp->size() > 1) ddp.push_back(dp::replicate(unit, dp));
      if (zero == 1 || zero == 2) {
        zero12.push_back(std::make_unique<zero::ZeroRedundancyOptimizer>(
            unit, make_optimizer(trainable_once({unit})), dp, zero_options.stage(zero)));
      }
    }
    // Every unit's (ZeRO-3: a unit's shard is registered in the chunk it was made for).
    if (zero12.empty()) optimizer = make_optimizer(trainable_once(units));
  }

  // Each unit's gradients, counted once across the layout: whole (DDP) or the
  // reduced shards (ZeRO), cut over tp or replicated on it.
  std::vector<GradPart> gradient_parts() {
    std::vector<GradPart> parts;
    for (size_t i = 0; i < units.size(); ++i) {
      const torch::nn::Module& unit = *units[i];
      NamedGrads grads;
      if (zero == 0) {
        for (const auto& p : dp::unique_parameters(unit)) grads.emplace_back(p.name, p.tensor.grad());
      }
      if (zero == 3) grads = zero::shard_gradients(unit);
      if (zero == 1 || zero == 2) grads = zero12[i]->shard_gradients();
      std::vector<GradPart> mine = count_once(grads, tp::shard_dims(unit), /*replicated_over_dp=*/zero == 0, coord);
      parts.insert(parts.end(), mine.begin(), mine.end());
    }
    return parts;
  }
};

Trainer::Trainer(torch::nn::Sequential model, const mesh::DeviceMesh& mesh, Loss loss, MakeOptimizer make_optimizer,
                 TrainerOptions options)
    : s_(std::make_unique<State>()) {
  MESHTRAIN_CHECK(options.zero() >= 0 && options.zero() <= 3, "train::Trainer: zero ", options.zero(),
                  " is not a ZeRO stage; use 0 (DDP), 1, 2 or 3");
  s_->world = mesh.world();
  s_->coord = mesh.coord();
  s_->dp = mesh.dp();
  s_->max_norm = options.clip_grad_norm();
  s_->zero = options.zero();
  s_->loss = loss;
  s_->model = model;
  pp::PipelineOptions pipeline = options.pipeline();
  const bool pipelined = mesh.pp()->size() > 1 || pipeline.virtual_stages() > 1;
  if (pipelined && pipeline.split_points().empty())
    pipeline.split_points(balanced_split(*model, mesh.pp()->size() * pipeline.virtual_stages()));
  pipeline.reduce_every_microbatch(options.zero() >= 2);  // ZeRO-2/3 keep shards, not full gradients, through the step
  s_->microbatches = pipeline.microbatches() > 0 ? pipeline.microbatches() : mesh.pp()->size();
  if (mesh.tp()->size() > 1 && !options.tp_plan().empty())
    tp::parallelize(*model, mesh.tp(), options.tp_plan(), options.tp_options());
  s_->root = model.ptr();
  s_->units = {s_->root};
  if (pipelined) {
    s_->pipeline.emplace(pp::pipeline(model, mesh.pp(), loss, pipeline));
    s_->model = nullptr;  // this rank keeps its stage only (the caller should drop its handle too)
    s_->root = s_->pipeline->module();
    s_->units = {s_->root};  // the module the pipeline pauses gradient sync on; each chunk under virtual stages
    if (pipeline.virtual_stages() > 1) s_->units.assign(s_->pipeline->chunks().begin(), s_->pipeline->chunks().end());
  }
  s_->wrap_data_axis(make_optimizer, options.zero_options());
}

Trainer::~Trainer() = default;

double Trainer::step(const at::Tensor& inputs, const at::Tensor& targets) {
  // Every rank checks, so a batch the micro-batches do not divide fails on all of them, never half the pipeline.
  MESHTRAIN_CHECK(!s_->pipeline || !inputs.defined() || inputs.size(0) % s_->microbatches == 0, "train::Trainer: a "
                  "batch of ", inputs.size(0), " samples does not divide into ", s_->microbatches, " micro-batches; "
                  "pass a multiple of ", s_->microbatches, " per data-parallel rank");
  for (auto& z : s_->zero12) z->zero_grad();
  if (s_->optimizer) s_->optimizer->zero_grad();
  double loss = 0;
  if (s_->pipeline) {
    loss = s_->pipeline->step(inputs, targets);
  } else {
    at::Tensor l = s_->loss(s_->model->forward(inputs), targets);
    l.backward();
    loss = l.item<double>();
  }
  if (s_->max_norm > 0) s_->grad_norm = clip_grad_norm(s_->gradient_parts(), s_->max_norm, *s_->world);
  for (auto& z : s_->zero12) z->step();
  if (s_->optimizer) s_->optimizer->step();
  at::Tensor mean = at::tensor({loss}, at::kDouble);
  s_->dp->all_reduce(mean, comm::ReduceOp::kAvg);
  return mean.item<double>();
}

double Trainer::last_grad_norm() const { return s_->grad_norm; }

const std::shared_ptr<torch::nn::Module>& Trainer::module() const { return s_->root; }

std::map<std::string, at::Tensor> Trainer::parameters_over_dp() {
  std::map<std::string, at::Tensor> out;
  if (s_->zero == 3) {
    for (const auto& unit : s_->units)
      for (auto& kv : zero::full_parameters(*unit)) out.emplace(kv.first, kv.second);
    return out;
  }
  for (auto& z : s_->zero12)
    for (auto& kv : z->consolidated_state(0).parameters) out[kv.first] = kv.second;
  if (!s_->zero12.empty() && s_->dp->rank() != 0) return {};
  if (s_->zero12.empty())
    for (const auto& kv : s_->root->named_parameters()) out[kv.key()] = kv.value().detach().clone();
  return out;
}

}  // namespace train
}  // namespace meshtrain
