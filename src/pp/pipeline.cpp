#include "meshtrain/pp.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <map>

#include "dp/gradient_sync.h"
#include "meshtrain/util.h"
#include "util/intercept.h"
#include "util/parameter_dict.h"

namespace meshtrain {
namespace pp {

std::vector<int64_t> parameter_counts(const torch::nn::SequentialImpl& model) {
  std::vector<int64_t> costs;
  for (const auto& child : model.children()) {
    int64_t n = 0;
    for (const auto& p : child->parameters()) n += p.numel();
    costs.push_back(std::max<int64_t>(n, 1));  // a parameter-free child still costs a little
  }
  return costs;
}

namespace {

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
// model's embedding and its head, Megatron's tied word embeddings) has one
// gradient in one process: the sum of its uses. Every rank builds the whole
// model, so each starts with the same values; the rank of the first stage
// that uses it owns it, and the others take it out of their stage's parameter
// list (their layers keep computing with the tensor, now a copy). step():
//   - as it starts, the owner sends the current value to every copy;
//   - after a copy's rank finishes its last backward through it (the last
//     micro-batch on its lowest stage using it), it sends the accumulated
//     gradient to the owner;
//   - before the owner's last backward through it, the owner adds the copies'
//     gradients to its own, so that backward's data-parallel reduction (DDP,
//     ZeRO, fully_shard, all reducing on the last micro-batch) reduces the sum.
// The ordering holds because a later stage's backward of a micro-batch ends
// before an earlier stage's starts. Only the owner's optimizer steps it, and
// checkpoints of the stages hold it once.
using detail::TiedGroup;

// The parameters held by more than one rank, found from the whole model, alike
// on every rank, in the order of the children.
std::vector<TiedGroup> tied_across_ranks(const torch::nn::SequentialImpl& model, const std::vector<int64_t>& bounds,
                                         int ranks) {
  std::vector<TiedGroup> groups;
  std::map<const void*, size_t> index;
  const auto children = model.children();
  for (size_t stage = 0; stage + 1 < bounds.size(); ++stage) {
    const int rank = static_cast<int>(stage) % ranks;
    for (int64_t i = bounds[stage]; i < bounds[stage + 1]; ++i) {
      for (const at::Tensor& p : children[i]->parameters()) {
        const auto found = index.emplace(p.unsafeGetTensorImpl(), groups.size());
        if (found.second) groups.push_back({p, rank, {}});
        groups[found.first->second].lowest_stage.emplace(rank, static_cast<int>(stage));
      }
    }
  }
  groups.erase(std::remove_if(groups.begin(), groups.end(), [](const auto& g) { return g.lowest_stage.size() < 2; }),
               groups.end());
  return groups;
}

// The groups PipelineOptions::tied declares for stages the caller built: this
// rank's tensor of each from its chunk's parameters by name.
std::vector<TiedGroup> declared_tied(const TiedNames& declared,
                                     const std::vector<std::shared_ptr<torch::nn::Module>>& chunks, int rank, int ranks,
                                     int stages) {
  std::vector<TiedGroup> groups;
  for (const auto& names : declared) {
    MESHTRAIN_CHECK(names.size() >= 2, "PipelineOptions::tied: a group needs at least two (stage, name) pairs");
    TiedGroup g;
    int first_stage = stages;
    for (const auto& [stage, name] : names) {
      MESHTRAIN_CHECK(stage >= 0 && stage < stages, "PipelineOptions::tied: stage ", stage, " of '", name,
                      "' is outside [0, ", stages, ")");
      first_stage = std::min(first_stage, stage);
      const int holder = stage % ranks;
      auto it = g.lowest_stage.emplace(holder, stage).first;
      it->second = std::min(it->second, stage);
      if (holder != rank) continue;
      const auto params = chunks[stage / ranks]->named_parameters();
      MESHTRAIN_CHECK(params.contains(name), "PipelineOptions::tied: stage ", stage, " has no parameter '", name,
                      "'; name it as the stage's module does (", params.size(), " parameters, e.g. '",
                      params.is_empty() ? std::string("none") : params.keys().front(), "')");
      // Two stages of one rank in a group must compute with one tensor (no message can tie them).
      MESHTRAIN_CHECK(!g.parameter.defined() || g.parameter.is_same(params[name]), "PipelineOptions::tied: stages ",
                      "of rank ", rank, " hold '", name, "' and another tensor of its group; let them share one tensor");
      g.parameter = params[name];
    }
    g.owner = first_stage % ranks;  // the first stage's rank, whatever the order of the pairs
    MESHTRAIN_CHECK(g.lowest_stage.size() >= 2, "PipelineOptions::tied: every stage of the group of '",
                    names.front().second, "' is on pipeline rank ", g.owner, "; let those stages share one tensor");
    groups.push_back(g);
  }
  return groups;
}

// On a rank holding a copy: no module of its chunks lists the parameter any more.
void take_out_of_parameters(const std::vector<std::shared_ptr<torch::nn::Module>>& chunks, const at::Tensor& p) {
  for (const auto& chunk : chunks) {
    for (const auto& m : chunk->modules(/*include_self=*/true)) {
      auto& dict = ParameterDict::of(*m);
      std::vector<std::string> keys;
      for (const auto& item : dict)
        if (item.value().unsafeGetTensorImpl() == p.unsafeGetTensorImpl()) keys.push_back(item.key());
      for (const auto& key : keys) dict.erase(key);
    }
  }
}

// Whether a parameter sits in two of this rank's chunks (interleaved stages sharing it).
bool shared_by_two_chunks(const std::vector<std::shared_ptr<torch::nn::Module>>& chunks) {
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
  auto stage = std::make_shared<torch::nn::SequentialImpl>();
  const auto named = model->named_children();
  std::vector<StageFn> fns;
  for (int k = 0; k < chunks; ++k) {
    const int s = pp_->rank() + k * ranks;
    auto chunk = std::make_shared<torch::nn::SequentialImpl>();
    for (int64_t i = bounds_[s]; i < bounds_[s + 1]; ++i) {
      chunk->push_back(named[i].key(), *(model->begin() + i));
      stage->push_back(named[i].key(), *(model->begin() + i));
    }
    chunks_.push_back(chunk);
    fns.push_back({s, [chunk](const at::Tensor& x, int) { return chunk->forward(x); }});
  }
  stage_ = stage;
  start(std::move(fns), tied_across_ranks(*model, bounds_, ranks));
}

Pipeline::Pipeline(std::vector<StageModule> my_stages, comm::CommPtr pp, PipelineLoss loss, PipelineOptions options)
    : pp_(std::move(pp)), loss_(std::move(loss)), options_(std::move(options)) {
  MESHTRAIN_CHECK(pp_ && loss_, "pp::Pipeline needs a communicator and a loss");
  const int ranks = pp_->size(), chunks = options_.virtual_stages();
  MESHTRAIN_CHECK(static_cast<int>(my_stages.size()) == chunks, "pp::Pipeline: rank ", pp_->rank(), " was given ",
                  my_stages.size(), " stages, but ", chunks, " virtual stage(s) per rank need as many (stage rank + k * ",
                  ranks, ")");
  MESHTRAIN_CHECK(options_.split_points().empty(), "pp::Pipeline: split_points do not apply to stages you built");
  if (options_.microbatches() == 0) options_.microbatches(ranks);
  validate(ScheduleSpec{options_.schedule(), ranks, options_.microbatches(), chunks});
  std::vector<StageFn> fns;
  auto holder = std::make_shared<torch::nn::Module>();
  for (int k = 0; k < chunks; ++k) {
    const StageModule& stage = my_stages[k];
    MESHTRAIN_CHECK(stage.module && stage.forward, "pp::Pipeline: stage ", pp_->rank() + k * ranks,
                    " has no module or no forward");
    chunks_.push_back(stage.module);
    holder->register_module(std::to_string(k), stage.module);
    fns.push_back({pp_->rank() + k * ranks, [forward = stage.forward](const at::Tensor& x, int) { return forward(x); }});
  }
  stage_ = chunks == 1 ? chunks_.front() : holder;
  start(std::move(fns), declared_tied(options_.tied(), chunks_, pp_->rank(), ranks, ranks * chunks));
}

void Pipeline::start(std::vector<StageFn> fns, const std::vector<TiedGroup>& groups) {
  const int ranks = pp_->size();
  stage_fns_ = fns;
  executor_ = std::make_unique<PipelineExecutor>(
      pp_, ScheduleSpec{options_.schedule(), ranks, options_.microbatches(), options_.virtual_stages()}, std::move(fns));
  int tag = kTiedTagBase;  // two per group (value, gradient), alike on every rank
  for (const TiedGroup& group : groups) {  // Note [Tied parameters across stages]
    tag += 2;
    const auto here = group.lowest_stage.find(pp_->rank());
    if (here == group.lowest_stage.end() || !group.parameter.requires_grad()) continue;  // a frozen one stays equal
    Tied t{group.parameter, group.owner, {}, here->second, tag};
    if (pp_->rank() == group.owner) {
      for (const auto& kv : group.lowest_stage)
        if (kv.first != group.owner) t.copies.push_back(kv.first);
    } else {
      take_out_of_parameters(chunks_, group.parameter);
    }
    tied_.push_back(t);
  }
  shared_by_chunks_ = shared_by_two_chunks(chunks_);
}

void Pipeline::sync_tied() {
  std::vector<comm::WorkPtr> sends;
  refresh_tied_copies(sends);
  for (auto& w : sends) w->wait();
}

void Pipeline::refresh_tied_copies(std::vector<comm::WorkPtr>& sends) {
  for (const Tied& t : tied_) {
    for (int rank : t.copies) sends.push_back(pp_->isend(t.parameter.detach().clone(), rank, user_tag(t.tag)));
  }
  at::NoGradGuard no_grad;
  for (Tied& t : tied_) {
    if (t.owner == pp_->rank()) continue;
    const at::Tensor value = pp_->recv_any(t.owner, user_tag(t.tag));
    MESHTRAIN_CHECK(value.sizes() == t.parameter.sizes(), "pp::Pipeline: the tied copy on rank ", pp_->rank(), " is ",
                    t.parameter.sizes(), " but its owner's parameter (rank ", t.owner, ") is ", value.sizes());
    // The owner computes in another dtype (fully_shard's param_dtype, bf16 masters): so does the copy, keeping
    // its roles (a tp-cut head's).
    if (value.scalar_type() != t.parameter.scalar_type())
      intercept::set_data_keeping_marks(t.parameter, at::empty(t.parameter.sizes(), value.options()));
    t.parameter.detach().copy_(value.view_as(t.parameter));
    t.parameter.mutable_grad().reset();
  }
}

// Called around every backward: on the last micro-batch, a copy's gradient
// leaves after its rank's last backward through it and the owner adds the
// copies' gradients before its own (Note [Tied parameters across stages]).
void Pipeline::exchange_tied_gradients(int stage, std::vector<comm::WorkPtr>& sends, bool before) {
  at::NoGradGuard no_grad;
  for (Tied& t : tied_) {
    if (t.last_backward_stage != stage) continue;
    const bool owner = t.owner == pp_->rank();
    if (before && owner) {
      for (int rank : t.copies) {
        const at::Tensor g = pp_->recv_any(rank, user_tag(t.tag + 1)).view_as(t.parameter);
        at::Tensor& grad = t.parameter.mutable_grad();
        if (grad.defined()) grad.add_(g);
        else grad = g.clone();
      }
    } else if (!before && !owner) {
      const at::Tensor& g = t.parameter.grad();
      sends.push_back(pp_->isend(g.defined() ? g : at::zeros_like(t.parameter), t.owner, user_tag(t.tag + 1)));
      // Sent every micro-batch (after_microbatch_backward): the next one's starts afresh.
      if (options_.after_microbatch_backward()) t.parameter.mutable_grad().reset();
    }
  }
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
  std::vector<comm::WorkPtr> sends;
  refresh_tied_copies(sends);
  // Every micro-batch's gradients whole after its backward, for a caller that takes each.
  const auto& each = options_.after_microbatch_backward();
  const bool every = static_cast<bool>(each);
  PipelineHooks hooks;
  hooks.before_backward = [&](int s, int mb) {
    if (every || mb == m - 1) exchange_tied_gradients(s, sends, /*before=*/true);
    dp::set_gradient_sync(chunk_of(s), every || options_.reduce_every_microbatch() || mb == m - 1);
  };
  hooks.after_backward = [&](int s, int mb) {
    dp::set_gradient_sync(chunk_of(s), true);
    if (every || mb == m - 1) exchange_tied_gradients(s, sends, /*before=*/false);
    if (every) each(s / pp_->size(), mb);
  };
  std::vector<double> losses(every && is_last() ? m : 0);
  StepResult r = executor_->run(
      in, out,
      [&](const at::Tensor& y, const at::Tensor& t, int mb) {
        at::Tensor l = loss_(y, t);
        if (every) losses[mb] = l.item<double>();
        return l / m;
      },
      hooks);
  for (auto& w : sends) w->wait();
  for (Tied& t : tied_)
    if (t.owner != pp_->rank()) t.parameter.mutable_grad().reset();  // sent: the copy's gradient is not kept
  last_.events = std::move(r.events);
  last_.max_in_flight = std::max(last_.max_in_flight, r.max_in_flight);
  if (every) share_microbatch_losses(losses);
  at::Tensor loss = at::tensor({r.loss_sum}, at::kDouble);
  pp_->broadcast(loss, pp_->size() - 1);
  return loss.item<double>();
}

void Pipeline::share_microbatch_losses(const std::vector<double>& on_last_stage) {
  at::Tensor losses = at::zeros({options_.microbatches()}, at::kDouble);
  if (is_last()) losses.copy_(at::tensor(on_last_stage, at::kDouble));
  pp_->broadcast(losses, pp_->size() - 1);
  microbatch_losses_.assign(losses.data_ptr<double>(), losses.data_ptr<double>() + losses.numel());
}

double Pipeline::evaluate(const at::Tensor& inputs, const at::Tensor& targets) {
  MESHTRAIN_CHECK(!is_first() || inputs.defined(), "pp::Pipeline::evaluate: the first stage needs the inputs");
  MESHTRAIN_CHECK(!is_last() || targets.defined(), "pp::Pipeline::evaluate: the last stage needs the targets");
  sync_tied();
  at::NoGradGuard no_grad;
  const int ranks = pp_->size(), last_stage = ranks * options_.virtual_stages() - 1;
  std::vector<comm::WorkPtr> sends;
  std::vector<at::Tensor> sent;  // alive until their sends complete
  at::Tensor x, loss = at::zeros({1}, at::kDouble);
  for (const StageFn& fn : stage_fns_) {  // this rank's stages, in order
    const int s = fn.stage;
    // The previous stage's output: the batch on stage 0, kept on this rank when
    // the previous stage is here too (pp 1 with virtual stages), else received.
    if (s == 0) x = inputs;
    else if ((s - 1) % ranks != pp_->rank()) x = pp_->recv_any((s - 1) % ranks, user_tag(kEvalTag));
    x = fn.forward(x, 0);
    if (s == last_stage) loss.fill_(loss_(x, targets).item<double>());
    else if ((s + 1) % ranks != pp_->rank()) {
      sent.push_back(x.contiguous());
      sends.push_back(pp_->isend(sent.back(), (s + 1) % ranks, user_tag(kEvalTag)));
    }
  }
  for (auto& w : sends) w->wait();
  pp_->broadcast(loss, ranks - 1);
  return loss.item<double>();
}

}  // namespace pp
}  // namespace meshtrain
