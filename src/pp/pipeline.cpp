#include "meshtrain/pp/pipeline.h"

#include <ATen/ATen.h>

#include "meshtrain/dp/gradient_sync.h"
#include "meshtrain/pp/schedule.h"
#include "meshtrain/util/error.h"

namespace meshtrain {
namespace pp {

namespace {

// The children's parameter counts: the cost a balanced split evens out.
std::vector<int64_t> parameter_counts(const torch::nn::SequentialImpl& model) {
  std::vector<int64_t> costs;
  for (const auto& child : model.children()) {
    int64_t n = 0;
    for (const auto& p : child->parameters()) n += p.numel();
    costs.push_back(std::max<int64_t>(n, 1));  // a parameter-free child still costs a little
  }
  return costs;
}

std::vector<int64_t> stage_bounds(const torch::nn::SequentialImpl& model, int stages,
                                  const std::vector<int64_t>& split_points) {
  const int64_t children = static_cast<int64_t>(model.size());
  MESHTRAIN_CHECK(children >= stages, "pp::pipeline: the model has ", children, " children, fewer than the ", stages,
                  " pipeline stages; give it more layers or use fewer stages");
  if (!split_points.empty()) return partition_explicit(split_points, children, stages);
  return partition_balanced(parameter_counts(model), stages);
}

}  // namespace

Pipeline::Pipeline(torch::nn::Sequential model, comm::CommPtr pp, PipelineLoss loss, PipelineOptions options)
    : pp_(std::move(pp)), loss_(std::move(loss)), options_(std::move(options)) {
  MESHTRAIN_CHECK(pp_ && !model.is_empty() && loss_, "pp::pipeline needs a model, a communicator and a loss");
  const int ranks = pp_->size(), chunks = options_.virtual_stages();
  if (options_.microbatches() == 0) options_.microbatches(ranks);
  const ScheduleSpec spec{options_.schedule(), ranks, options_.microbatches(), chunks};
  validate(spec);
  bounds_ = stage_bounds(*model, spec.stages(), options_.split_points());
  // This rank's children, under their names in the whole model, chunk by chunk.
  stage_ = std::make_shared<torch::nn::SequentialImpl>();
  const auto named = model->named_children();
  std::vector<StageFn> fns;
  for (int k = 0; k < chunks; ++k) {
    const int s = pp_->rank() + k * ranks;
    auto chunk = std::make_shared<torch::nn::SequentialImpl>();
    for (int64_t i = bounds_[s]; i < bounds_[s + 1]; ++i) {
      chunk->push_back(named[i].key(), *(model->begin() + i));
      stage_->push_back(named[i].key(), *(model->begin() + i));
    }
    chunks_.push_back(chunk);
    fns.push_back({s, [chunk](const at::Tensor& x, int) { return chunk->forward(x); }});
  }
  executor_ = std::make_unique<PipelineExecutor>(pp_, spec, std::move(fns));
}

double Pipeline::step(const at::Tensor& inputs, const at::Tensor& targets) {
  const int m = options_.microbatches();
  auto split = [&](const at::Tensor& t, const char* what) {
    if (!t.defined()) return std::vector<at::Tensor>{};
    MESHTRAIN_CHECK(t.dim() >= 1 && t.size(0) % m == 0, "pp::pipeline: the ", what, " hold ",
                    t.dim() >= 1 ? t.size(0) : 0, " samples, which ", m,
                    " micro-batches do not divide; give a batch that is a multiple of ", m,
                    " or change PipelineOptions::microbatches");
    return t.split(t.size(0) / m);
  };
  const std::vector<at::Tensor> in = is_first() ? split(inputs, "inputs") : std::vector<at::Tensor>{};
  const std::vector<at::Tensor> out = is_last() ? split(targets, "targets") : std::vector<at::Tensor>{};
  MESHTRAIN_CHECK(!is_first() || !in.empty(), "pp::pipeline: the first stage needs the inputs");
  MESHTRAIN_CHECK(!is_last() || !out.empty(), "pp::pipeline: the last stage needs the targets");
  // Data-parallel wrappers reduce on each chunk's last micro-batch only.
  const int chunks = options_.virtual_stages();
  MESHTRAIN_CHECK(chunks == 1 || !dp::has_gradient_sync(*stage_), "pp::pipeline: a data-parallel wrapper holds the "
                  "whole stage, but with ", chunks, " virtual stages each chunk's backward runs apart; wrap each of "
                  "stage.chunks() instead (or zero::fully_shard the children)");
  auto chunk_of = [&](int stage) -> const torch::nn::Module& {
    return chunks == 1 ? *stage_ : *chunks_[stage / pp_->size()];
  };
  PipelineHooks hooks;
  hooks.before_backward = [&](int s, int mb) { dp::set_gradient_sync(chunk_of(s), mb == m - 1); };
  hooks.after_backward = [&](int s, int) { dp::set_gradient_sync(chunk_of(s), true); };
  const StepResult r = executor_->run(
      in, out, [&](const at::Tensor& y, const at::Tensor& t, int) { return loss_(y, t) / m; }, hooks);
  at::Tensor loss = at::tensor({r.loss_sum}, at::kDouble);
  pp_->broadcast(loss, pp_->size() - 1);
  return loss.item<double>();
}

}  // namespace pp
}  // namespace meshtrain
