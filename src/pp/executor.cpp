#include "meshtrain/pp/executor.h"

#include <ATen/ATen.h>

#include <chrono>

#include "meshtrain/util/error.h"

namespace meshtrain {
namespace pp {

int activation_tag(int stage, int mb) { return (stage * 2) * 8192 + mb; }
int gradient_tag(int stage, int mb) { return (stage * 2 + 1) * 8192 + mb; }
int user_tag(int id) { return (1 << 29) + id; }

PipelineExecutor::PipelineExecutor(comm::CommPtr pp, ScheduleSpec spec, std::vector<StageFn> stages)
    : pp_(std::move(pp)), spec_(spec) {
  MESHTRAIN_CHECK(pp_ && pp_->size() == spec_.ranks, "PipelineExecutor: the communicator has ",
                  pp_ ? pp_->size() : 0, " ranks, the schedule ", spec_.ranks);
  MESHTRAIN_CHECK(spec_.microbatches < 8192, "at most 8191 micro-batches per step");
  for (auto& s : stages) stages_[s.stage] = std::move(s);
  MESHTRAIN_CHECK(static_cast<int>(stages_.size()) == spec_.virtual_stages, "PipelineExecutor: rank ", pp_->rank(),
                  " holds ", stages_.size(), " stages; the schedule gives it ", spec_.virtual_stages);
  actions_ = make_schedule(spec_).at(pp_->rank());
  for (const auto& a : actions_) {
    if (a.kind == ActionKind::kForward) {
      MESHTRAIN_CHECK(stages_.count(a.stage), "PipelineExecutor: rank ", pp_->rank(), " lacks stage ", a.stage);
    }
  }
}

StepResult PipelineExecutor::run(const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& targets,
                                 const LossFn& loss, const PipelineHooks& hooks) {
  using Clock = std::chrono::steady_clock;
  const auto t0 = Clock::now();
  auto now = [&] { return std::chrono::duration<double>(Clock::now() - t0).count(); };
  const int last = spec_.stages() - 1, me = pp_->rank();
  StepResult result;
  // Per (stage, micro-batch): the stage's input (leaf), its output or loss, the output's gradient.
  std::map<std::pair<int, int>, at::Tensor> in, out, grad_out;
  std::map<std::pair<int, int>, at::Tensor> local;  // activations/gradients handed to a stage on this rank
  std::vector<comm::WorkPtr> sends;
  // Every receive of the step is posted now, so that small activations and
  // gradients land while this rank computes (see Note [Point-to-point messages]).
  std::map<size_t, comm::WorkPtr> posted;
  for (size_t i = 0; i < actions_.size(); ++i) {
    const Action& a = actions_[i];
    if (a.peer == me) continue;
    if (a.kind == ActionKind::kRecvActivation) posted[i] = pp_->irecv_any(a.peer, activation_tag(a.stage, a.microbatch));
    if (a.kind == ActionKind::kRecvGrad) posted[i] = pp_->irecv_any(a.peer, gradient_tag(a.stage, a.microbatch));
  }
  size_t index = 0;  // of the action being run
  auto receive = [&](const Action& a, int) {
    if (a.peer == me) {
      auto it = local.find({a.stage, a.microbatch});
      MESHTRAIN_CHECK(it != local.end(), "pipeline: local hand-off ", to_string(a), " missing");
      at::Tensor t = it->second;
      local.erase(it);
      return t;
    }
    comm::WorkPtr& w = posted.at(index);
    w->wait();
    at::Tensor t = w->result().at(0);
    w.reset();
    return t;
  };
  auto send = [&](const Action& a, const at::Tensor& t, int tag) {
    if (a.peer == me) {
      local[{a.stage, a.microbatch}] = t;
    } else {
      sends.push_back(pp_->isend(t, a.peer, tag));
    }
  };
  for (; index < actions_.size(); ++index) {
    const Action& a = actions_[index];
    const std::pair<int, int> key{a.stage, a.microbatch};
    switch (a.kind) {
      case ActionKind::kRecvActivation: {  // the output of stage a.stage becomes the input of a.stage + 1
        at::Tensor x = receive(a, activation_tag(a.stage, a.microbatch));
        if (at::isFloatingType(x.scalar_type())) x.requires_grad_(true);
        in[{a.stage + 1, a.microbatch}] = x;
        break;
      }
      case ActionKind::kForward: {
        if (a.stage == 0) in[key] = inputs.at(a.microbatch);
        if (hooks.before_forward) hooks.before_forward(a.stage, a.microbatch);
        const double start = now();
        at::Tensor y = stages_.at(a.stage).forward(in.at(key), a.microbatch);
        if (a.stage == last) {
          y = loss(y, targets.at(a.microbatch), a.microbatch);
          result.loss_sum += y.item<double>();
        }
        out[key] = y;
        result.events.push_back({me, a.stage, a.microbatch, true, start, now()});
        result.max_in_flight = std::max(result.max_in_flight, static_cast<int>(out.size()));
        if (hooks.after_forward) hooks.after_forward(a.stage, a.microbatch);
        break;
      }
      case ActionKind::kSendActivation:
        send(a, out.at(key).detach(), activation_tag(a.stage, a.microbatch));
        break;
      case ActionKind::kRecvGrad:  // the gradient of stage a.stage's input is the one of a.stage - 1's output
        grad_out[{a.stage - 1, a.microbatch}] = receive(a, gradient_tag(a.stage, a.microbatch));
        break;
      case ActionKind::kBackward: {
        if (hooks.before_backward) hooks.before_backward(a.stage, a.microbatch);
        const double start = now();
        if (a.stage == last) {
          out.at(key).backward();
        } else {
          out.at(key).backward(grad_out.at(key));
          grad_out.erase(key);
        }
        out.erase(key);
        result.events.push_back({me, a.stage, a.microbatch, false, start, now()});
        if (hooks.after_backward) hooks.after_backward(a.stage, a.microbatch);
        if (a.stage == 0) in.erase(key);
        break;
      }
      case ActionKind::kSendGrad: {
        at::Tensor x = in.at(key);
        MESHTRAIN_CHECK(x.grad().defined(), "pipeline: stage ", a.stage, " produced no gradient for its input");
        send(a, x.grad(), gradient_tag(a.stage, a.microbatch));
        in.erase(key);
        break;
      }
    }
  }
  for (auto& w : sends) w->wait();
  return result;
}

}  // namespace pp
}  // namespace meshtrain
