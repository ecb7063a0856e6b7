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
  MESHTRAIN_CHECK(options_.schedule() != "interleaved", "pp::pipeline: the interleaved schedule needs several "
                  "stages per rank, which pp::pipeline does not cut yet; use naive, gpipe or 1f1b "
                  "(the trainer's --virtual-stages runs it)");
  const int stages = pp_->size();
  if (options_.microbatches() == 0) options_.microbatches(stages);
  validate(ScheduleSpec{options_.schedule(), stages, options_.microbatches(), 1});
  bounds_ = stage_bounds(*model, stages, options_.split_points());
  // This rank's children, under their names in the whole model.
  stage_ = std::make_shared<torch::nn::SequentialImpl>();
  const auto named = model->named_children();
  for (int64_t i = first_child(); i < last_child(); ++i) stage_->push_back(named[i].key(), *(model->begin() + i));
  auto stage = stage_;
  executor_ = std::make_unique<PipelineExecutor>(
      pp_, ScheduleSpec{options_.schedule(), stages, options_.microbatches(), 1},
      std::vector<StageFn>{{pp_->rank(), [stage](const at::Tensor& x, int) { return stage->forward(x); }}});
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
  PipelineHooks hooks;
  // Data-parallel wrappers of the stage reduce on the last micro-batch only.
  hooks.before_backward = [&](int, int mb) { dp::set_gradient_sync(*stage_, mb == m - 1); };
  hooks.after_backward = [&](int, int) { dp::set_gradient_sync(*stage_, true); };
  const StepResult r = executor_->run(
      in, out, [&](const at::Tensor& y, const at::Tensor& t, int) { return loss_(y, t) / m; }, hooks);
  at::Tensor loss = at::tensor({r.loss_sum}, at::kDouble);
  pp_->broadcast(loss, pp_->size() - 1);
  return loss.item<double>();
}

}  // namespace pp
}  // namespace meshtrain
