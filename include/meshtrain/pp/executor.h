#pragma once
// The one pipeline executor: runs this rank's actions of any schedule
// (schedule.h). Activations and their gradients travel with isend (buffered)
// and blocking receives of tensors whose shapes need not be known in advance.
// Hooks let the caller wrap the compute (data-parallel gradient sync on the
// last micro-batch, tied weights between the first and last stage).

#include <functional>
#include <map>
#include <vector>

#include "meshtrain/comm/communicator.h"
#include "meshtrain/pp/schedule.h"

namespace meshtrain {
namespace pp {

// A stage held by this rank: its index and its forward function.
struct StageFn {
  int stage;
  std::function<at::Tensor(const at::Tensor&, int microbatch)> forward;
};

struct PipelineHooks {
  std::function<void(int stage, int microbatch)> before_forward;
  std::function<void(int stage, int microbatch)> after_forward;
  std::function<void(int stage, int microbatch)> before_backward;
  std::function<void(int stage, int microbatch)> after_backward;
};

// One executed compute action, for timelines (seconds since the step began).
struct TraceEvent {
  int rank;
  int stage;
  int microbatch;
  bool forward;
  double start, end;
};

struct StepResult {
  double loss_sum = 0;  // sum over micro-batches of the (scaled) losses, last stage only
  std::vector<TraceEvent> events;
  int max_in_flight = 0;  // activations held for backward, at most
};

using LossFn = std::function<at::Tensor(const at::Tensor& output, const at::Tensor& targets, int microbatch)>;

class PipelineExecutor {
 public:
  // `stages`: this rank's stages (one per virtual stage), any order.
  PipelineExecutor(comm::CommPtr pp, ScheduleSpec spec, std::vector<StageFn> stages);
  // inputs[mb] are read on the rank of stage 0, targets[mb] on the rank of the
  // last stage; loss(output, targets[mb], mb) there starts each micro-batch's backward.
  StepResult run(const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& targets, const LossFn& loss,
                 const PipelineHooks& hooks = {});
  const std::vector<Action>& actions() const { return actions_; }

 private:
  comm::CommPtr pp_;
  ScheduleSpec spec_;
  std::map<int, StageFn> stages_;
  std::vector<Action> actions_;
};

// Message tags of the pipeline (activations, gradients, and the caller's own).
int activation_tag(int stage, int microbatch);
int gradient_tag(int stage, int microbatch);
int user_tag(int id);

}  // namespace pp
}  // namespace meshtrain
