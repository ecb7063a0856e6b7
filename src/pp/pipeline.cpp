#include "meshtrain/pp/pipeline.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <map>
#include <set>

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

// Note [Tied parameters across stages]
// A parameter that children of stages on different ranks share (a language
// model's embedding and its head, Megatron's tied word embeddings) gets a
// gradient on each of those ranks, each the part of its own uses; the
// one-process gradient is their sum. Every rank builds the whole model, so
// each holds the same values: step() sums the gradient over the ranks that
// hold the parameter (after the data-parallel reduction, which commutes with
// it), and the optimizers then keep the copies equal. The groups come from the
// whole model, alike on every rank, in the order of the children.
// For each parameter held by more than one rank: those ranks, and the parameter.
using TiedGroup = std::pair<std::set<int>, std::pair<std::string, at::Tensor>>;  // ranks, (a name, the parameter)
std::vector<TiedGroup> tied_across_ranks(const torch::nn::SequentialImpl& model, const std::vector<int64_t>& bounds,
                                         int ranks) {
  std::vector<TiedGroup> groups;
  std::map<const void*, size_t> index;
  const auto children = model.named_children();
  for (size_t stage = 0; stage + 1 < bounds.size(); ++stage) {
    for (int64_t i = bounds[stage]; i < bounds[stage + 1]; ++i) {
      for (const auto& p : children[i].value()->named_parameters()) {
        const auto found = index.emplace(p.value().unsafeGetTensorImpl(), groups.size());
        if (found.second) groups.push_back({{}, {children[i].key() + "." + p.key(), p.value()}});
        groups[found.first->second].first.insert(static_cast<int>(stage) % ranks);
      }
    }
  }
  groups.erase(std::remove_if(groups.begin(), groups.end(), [](const auto& g) { return g.first.size() < 2; }),
               groups.end());
  return groups;
}

// Whether a parameter sits in two of this rank's chunks (interleaved stages sharing it).
bool shared_by_two_chunks(const std::vector<std::shared_ptr<torch::nn::SequentialImpl>>& chunks) {
  std::map<const void*, size_t> chunk_of;
  for (size_t c = 0; c < chunks.size(); ++c) {
    for (const at::Tensor& p : chunks[c]->parameters()) {
      const auto found = chunk_of.emplace(p.unsafeGetTensorImpl(), c);
      if (!found.second && found.first->second != c) return true;
    }
  }
  return false;
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
  for (const auto& group : tied_across_ranks(*model, bounds_, ranks)) {  // Note [Tied parameters across stages]
    const bool mine = group.first.count(pp_->rank()) > 0;
    comm::CommPtr holders = pp_->split(mine ? 0 : -1, pp_->rank(), "tied");
    if (mine) tied_.push_back({group.second.first, group.second.second, holders});
  }
  shared_by_chunks_ = shared_by_two_chunks(chunks_);
}

// A wrapper that shards gradients (ZeRO-2/3, zero::fully_shard) leaves no
// full gradient to sum: the first step checks, on every holder alike, that
// each holder has one (a sum of zeros would be silently wrong).
void Pipeline::sum_tied_gradients() {
  for (auto& t : tied_) {
    if (!t.parameter.requires_grad()) continue;
    if (!tied_checked_) {
      at::Tensor with_grad = at::full({1}, t.parameter.grad().defined() ? 1.0 : 0.0, at::kDouble);
      t.holders->all_reduce(with_grad);
      const int have = static_cast<int>(with_grad.item<double>());
      MESHTRAIN_CHECK(have == t.holders->size(), "pp::pipeline: the parameter that pipeline ranks share (tied, '",
                      t.name, "') has a gradient after the step on ", have, " of the ", t.holders->size(),
                      " ranks that hold it: a wrapper that shards gradients (ZeRO-2/3, zero::fully_shard) took it, or "
                      "a stage does not use it; tied parameters across stages work with dp::replicate and ZeRO-1");
    }
    t.holders->all_reduce(t.parameter.mutable_grad());
  }
  tied_checked_ = true;
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
  // Each chunk's wrapper would hook the shared parameter's gradient: the
  // first chunk's finished backward would find it still on its way.
  MESHTRAIN_CHECK(!shared_by_chunks_ || std::none_of(chunks_.begin(), chunks_.end(), [](const auto& c) {
    return dp::has_gradient_sync(*c);
  }), "pp::pipeline: two of this rank's chunks share a parameter (tied), and data-parallel wrappers on the chunks "
      "would each reduce its gradient; wrap the children that do not share it, or place the tied children on "
      "different ranks");
  auto chunk_of = [&](int stage) -> const torch::nn::Module& {
    return chunks == 1 ? *stage_ : *chunks_[stage / pp_->size()];
  };
  PipelineHooks hooks;
  hooks.before_backward = [&](int s, int mb) { dp::set_gradient_sync(chunk_of(s), mb == m - 1); };
  hooks.after_backward = [&](int s, int) { dp::set_gradient_sync(chunk_of(s), true); };
  const StepResult r = executor_->run(
      in, out, [&](const at::Tensor& y, const at::Tensor& t, int) { return loss_(y, t) / m; }, hooks);
  sum_tied_gradients();
  at::Tensor loss = at::tensor({r.loss_sum}, at::kDouble);
  pp_->broadcast(loss, pp_->size() - 1);
  return loss.item<double>();
}

}  // namespace pp
}  // namespace meshtrain
