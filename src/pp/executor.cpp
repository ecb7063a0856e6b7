#include "meshtrain/pp.h"

#include <ATen/ATen.h>

#include <chrono>

#include "meshtrain/util.h"

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

namespace {

using Key = std::pair<int, int>;  // (stage, micro-batch)

// One step of a PipelineExecutor on this rank: the tensors in flight and the
// action handlers. Lives for one run().
class StepRun {
 public:
  StepRun(comm::Communicator& pp, const std::map<int, StageFn>& stages, const std::vector<Action>& actions,
          int last_stage, const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& targets,
          const LossFn& loss, const PipelineHooks& hooks)
      : pp_(pp), stages_(stages), actions_(actions), last_(last_stage), me_(pp.rank()), inputs_(inputs),
        targets_(targets), loss_(loss), hooks_(hooks), t0_(Clock::now()) {}

  StepResult run() {
    post_receives();
    for (index_ = 0; index_ < actions_.size(); ++index_) run_action(actions_[index_]);
    for (auto& w : sends_) w->wait();
    return std::move(result_);
  }

 private:
  using Clock = std::chrono::steady_clock;
  double now() const { return std::chrono::duration<double>(Clock::now() - t0_).count(); }

  // Every receive of the step is posted now, so that small activations and
  // gradients land while this rank computes (see Note [Point-to-point messages]).
  void post_receives() {
    for (size_t i = 0; i < actions_.size(); ++i) {
      const Action& a = actions_[i];
      if (a.peer == me_) continue;
      if (a.kind == ActionKind::kRecvActivation) posted_[i] = pp_.irecv_any(a.peer, activation_tag(a.stage, a.microbatch));
      if (a.kind == ActionKind::kRecvGrad) posted_[i] = pp_.irecv_any(a.peer, gradient_tag(a.stage, a.microbatch));
    }
  }

  void run_action(const Action& a) {
    const Key key{a.stage, a.microbatch};
    switch (a.kind) {
      case ActionKind::kRecvActivation: {  // the output of stage a.stage becomes the input of a.stage + 1
        at::Tensor x = receive(a);
        if (at::isFloatingType(x.scalar_type())) x.requires_grad_(true);
        in_[{a.stage + 1, a.microbatch}] = x;
        break;
      }
      case ActionKind::kForward: forward(a, key); break;
      case ActionKind::kSendActivation: send(a, out_.at(key).detach(), activation_tag(a.stage, a.microbatch)); break;
      case ActionKind::kRecvGrad:  // the gradient of stage a.stage's input is the one of a.stage - 1's output
        grad_out_[{a.stage - 1, a.microbatch}] = receive(a);
        break;
      case ActionKind::kBackward: backward(a, key); break;
      case ActionKind::kSendGrad: send_input_grad(a, key); break;
    }
  }

  at::Tensor receive(const Action& a) {
    if (a.peer == me_) {
      auto it = local_.find({a.stage, a.microbatch});
      MESHTRAIN_CHECK(it != local_.end(), "pipeline: local hand-off ", to_string(a), " missing");
      at::Tensor t = it->second;
      local_.erase(it);
      return t;
    }
    comm::WorkPtr& w = posted_.at(index_);
    w->wait();
    at::Tensor t = w->result().at(0);
    w.reset();
    return t;
  }

  void send(const Action& a, const at::Tensor& t, int tag) {
    if (a.peer == me_) {
      local_[{a.stage, a.microbatch}] = t;
    } else {
      sends_.push_back(pp_.isend(t, a.peer, tag));
    }
  }

  void forward(const Action& a, const Key& key) {
    if (a.stage == 0) in_[key] = inputs_.at(a.microbatch);
    if (hooks_.before_forward) hooks_.before_forward(a.stage, a.microbatch);
    const double start = now();
    at::Tensor y = stages_.at(a.stage).forward(in_.at(key), a.microbatch);
    if (a.stage == last_) {
      y = loss_(y, targets_.at(a.microbatch), a.microbatch);
      result_.loss_sum += y.item<double>();
    }
    out_[key] = y;
    result_.events.push_back({me_, a.stage, a.microbatch, true, start, now()});
    result_.max_in_flight = std::max(result_.max_in_flight, static_cast<int>(out_.size()));
    if (hooks_.after_forward) hooks_.after_forward(a.stage, a.microbatch);
  }

  void backward(const Action& a, const Key& key) {
    if (hooks_.before_backward) hooks_.before_backward(a.stage, a.microbatch);
    const double start = now();
    if (a.stage == last_) {
      out_.at(key).backward();
    } else {
      out_.at(key).backward(grad_out_.at(key));
      grad_out_.erase(key);
    }
    out_.erase(key);
    result_.events.push_back({me_, a.stage, a.microbatch, false, start, now()});
    if (hooks_.after_backward) hooks_.after_backward(a.stage, a.microbatch);
    if (a.stage == 0) in_.erase(key);
  }

  void send_input_grad(const Action& a, const Key& key) {
    at::Tensor x = in_.at(key);
    MESHTRAIN_CHECK(x.grad().defined(), "pipeline: stage ", a.stage, " produced no gradient for its input");
    send(a, x.grad(), gradient_tag(a.stage, a.microbatch));
    in_.erase(key);
  }

  comm::Communicator& pp_;
  const std::map<int, StageFn>& stages_;
  const std::vector<Action>& actions_;
  const int last_, me_;
  const std::vector<at::Tensor>& inputs_;
  const std::vector<at::Tensor>& targets_;
  const LossFn& loss_;
  const PipelineHooks& hooks_;
  const Clock::time_point t0_;
  StepResult result_;
  // Per (stage, micro-batch): the stage's input (leaf), its output or loss, the output's gradient.
  std::map<Key, at::Tensor> in_, out_, grad_out_;
  std::map<Key, at::Tensor> local_;  // activations/gradients handed to a stage on this rank
  std::vector<comm::WorkPtr> sends_;
  std::map<size_t, comm::WorkPtr> posted_;  // by action index
  size_t index_ = 0;                        // of the action being run
};

}  // namespace

StepResult PipelineExecutor::run(const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& targets,
                                 const LossFn& loss, const PipelineHooks& hooks) {
  return StepRun(*pp_, stages_, actions_, spec_.stages() - 1, inputs, targets, loss, hooks).run();
}

}  // namespace pp
}  // namespace meshtrain
