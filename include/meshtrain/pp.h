#pragma once
// meshtrain/pp.h: pipeline parallelism: GPipe, 1F1B, interleaved schedules and their executor.
// Part of the public API (meshtrain/meshtrain.h includes it); the sections below
// are in dependency order.

#include <torch/arg.h>
#include <torch/nn/modules/container/sequential.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "meshtrain/comm.h"

// ===== schedule =====
// Pipeline schedules as data (pure). A model is cut into S = ranks x V stages
// (V virtual stages, "chunks", per rank for interleaving); stage s runs on rank
// s % ranks as its chunk s / ranks. A schedule is, per rank, the list of actions
// it executes in order: forward or backward of a micro-batch on a stage, and the
// sends and receives of activations (forward) and their gradients (backward).
// Printed as "1F3" (stage 1, forward, micro-batch 3), "1B3", "send 1F3>2",
// "recv 0F3<0" ... One executor (below) runs any of them.
//
//   naive        the article's model parallelism: one micro-batch at a time,
//                forward through all stages then backward (bubble (p-1)/p)
//   gpipe        all forwards, then all backwards (holds m micro-batches)
//   1f1b         PipeDream-flush: p-r-1 warm-up forwards on rank r, then one
//                forward / one backward (holds at most p micro-batches)
//   interleaved  Megatron's interleaved 1F1B with V chunks per rank (bubble
//                divided by V); needs micro-batches divisible by the ranks

namespace meshtrain {
namespace pp {

enum class ActionKind { kForward, kBackward, kSendActivation, kRecvActivation, kSendGrad, kRecvGrad };

struct Action {
  ActionKind kind;
  int stage;       // the stage computed, or the stage whose output/gradient is moved
  int microbatch;
  int peer = -1;   // for sends and receives: the other rank
  bool operator==(const Action& o) const {
    return kind == o.kind && stage == o.stage && microbatch == o.microbatch && peer == o.peer;
  }
};

std::string to_string(const Action& a);
std::string to_string(const std::vector<Action>& actions);

struct ScheduleSpec {
  std::string kind = "1f1b";  // naive | gpipe | 1f1b | interleaved
  int ranks = 1;              // pipeline ranks p
  int microbatches = 1;       // m
  int virtual_stages = 1;     // V (chunks per rank)
  int stages() const { return ranks * virtual_stages; }
};

// Checks the spec; ConfigError naming the value and the fix.
void validate(const ScheduleSpec& spec);
// Per rank, the actions in execution order (compute and communication).
std::vector<std::vector<Action>> make_schedule(const ScheduleSpec& spec);
// Rank that runs stage s.
inline int rank_of_stage(int stage, int ranks) { return stage % ranks; }

// Result of replaying a schedule with blocking receives and buffered sends.
struct Replay {
  bool completes = false;        // no deadlock: every action ran
  std::string problem;           // why not, when it did not
  std::vector<int> max_in_flight;  // per rank: micro-batches forwarded but not yet backwarded (max)
};
// Replays the schedule (pure): checks every forward precedes its backward on
// its rank, every send pairs with exactly one receive on the peer, and that it
// runs to the end; reports activations held in flight.
Replay replay(const ScheduleSpec& spec, const std::vector<std::vector<Action>>& schedule);

// Whether every stage runs all its forwards of the step before its first
// backward (gpipe, or any schedule of one micro-batch; 1f1b, interleaved and
// naive run a backward before the last forward): what a statistic of the
// whole step, read in backward, needs (a mixture of experts' global-batch
// balance loss, meshtrain/moe.h).
bool forwards_before_backwards(const ScheduleSpec& spec);

// The bubble fraction the schedule should have: (p-1)/(m+p-1), divided by V
// when interleaved; (p-1)/p for naive.
double ideal_bubble(const ScheduleSpec& spec);

// Contiguous partition of pieces with the given costs into `parts` groups,
// minimizing the most expensive group. Returns part boundaries (parts + 1
// values, first 0, last pieces.size()). Throws when parts > pieces.
std::vector<int64_t> partition_balanced(const std::vector<int64_t>& costs, int parts);
// The partition a user chose: `starts` holds the first piece of parts 1..parts-1.
// Returns the parts + 1 boundaries; ConfigError naming the problem otherwise.
std::vector<int64_t> partition_explicit(const std::vector<int64_t>& starts, int64_t pieces, int parts);

// ===== executor =====
// The one pipeline executor: runs this rank's actions of any schedule
// (above). Activations and their gradients travel with isend (buffered)
// and blocking receives of tensors whose shapes need not be known in advance.
// Hooks let the caller wrap the compute (data-parallel gradient sync on the
// last micro-batch, tied weights between the first and last stage).

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

// ===== pipeline =====
// pp::pipeline: a user's torch::nn::Sequential cut into pipeline stages, one
// per rank of the pipeline communicator, trained with a schedule (GPipe,
// 1F1B, naive), the loss given once:
//
//   auto stage = pp::pipeline(my_sequential, mesh.pp(), loss_fn,
//                             pp::PipelineOptions().schedule("1f1b").microbatches(8));
//   torch::optim::Adam optimizer(stage->parameters(), 1e-3);   // this rank's layers only
//   double loss = stage.step(inputs, targets);                  // forward + backward, every micro-batch
//   optimizer.step();
//
// Every rank builds the whole model (same seed: same weights), and keeps its
// contiguous run of children, registered under their names in the whole
// model ("3.weight" whichever stage holds child 3), so checkpoints and
// comparisons line up. The split is `split_points` (the first child of
// stages 1..S-1) or balanced by parameter count.
//
// Interleaved (Megatron's virtual stages): with schedule "interleaved" and
// virtual_stages V > 1 the model is cut into S = pp x V stages and rank r
// holds V chunks, stages r, r + pp, r + 2 pp, ...: the bubble shrinks by V,
// at V times the activation messages. stage.module() holds every chunk's
// children; stage.chunks() each chunk apart.
//
// Tied parameters: a parameter that children of stages on different ranks
// share (an embedding and the LM head that reuses its weight) belongs to the
// rank of the first stage that uses it, the owner, as in one process: only
// there is it in stage->parameters() (what the optimizer and data-parallel
// wrappers see). The other ranks compute with a copy that step() refreshes
// from the owner as it starts, and send the copy's gradient back before the
// owner's last backward, so any wrapper (dp::replicate, ZeRO 1/2,
// zero::fully_shard) reduces the sum. Between steps, read the owner's value,
// or call sync_tied() on every pipeline rank to bring the copies up to date
// (after the last step, or after loading a checkpoint into the owner).
// Its messages use pp::user_tag ids from kTiedTagBase on: keep clear of them.
//
// Composes without hooks: wrap the stage with dp::replicate (or ZeRO 1/2, or
// zero::fully_shard its children) along the data axis, and step() pauses
// their gradient reduction for all but the last micro-batch
// (dp/gradient_sync.h); tensor-parallel layers inside the children run their
// collectives as usual. With virtual stages each chunk's backward runs apart,
// so wrap each chunk (for (auto& c : stage.chunks()) dp::replicate(c, dp)) or
// fully_shard the children; a wrapper of the whole stage is refused.

// Groups of (stage, parameter name) that share one parameter (PipelineOptions::tied).
using TiedNames = std::vector<std::vector<std::pair<int, std::string>>>;

struct PipelineOptions {
  TORCH_ARG(std::string, schedule) = "1f1b";  // naive | gpipe | 1f1b
  TORCH_ARG(int, microbatches) = 0;           // 0: one per rank
  // Chunks per rank, with schedule "interleaved" (S = pp x virtual_stages stages).
  TORCH_ARG(int, virtual_stages) = 1;
  // The first child of each stage after the first (S - 1 increasing indices);
  // empty: balanced by parameter count.
  TORCH_ARG(std::vector<int64_t>, split_points) = {};
  // With stages the caller built (the second constructor): parameters shared
  // across stages, each group its (stage, parameter name in that stage's
  // module) pairs, the owner's first: {{{0, "tok.weight"}, {S - 1, "head.weight"}}}.
  // The others hold a copy of the same shape (its values come from the owner).
  TORCH_ARG(TiedNames, tied) = {};
  // Data-parallel wrappers reduce after every micro-batch's backward instead
  // of the last only: for ZeRO-2/3, which then keep gradient shards, not
  // full-size gradients, through the step (DeepSpeed's way; more traffic).
  TORCH_ARG(bool, reduce_every_microbatch) = false;
  // Called after every micro-batch's backward on this rank with the chunk
  // (index into chunks()) and the micro-batch, once that micro-batch's
  // gradients are whole: when it is set, data-parallel wrappers reduce every
  // micro-batch and tied copies send their gradient to the owner after every
  // micro-batch (not the last only), and microbatch_losses() keeps each loss.
  // For a caller that sums the micro-batches' gradients itself
  // (train::Trainer's deterministic mode).
  TORCH_ARG(std::function<void(int chunk, int microbatch)>, after_microbatch_backward) = nullptr;
};

// The loss of one micro-batch's output. step() divides it by the number of
// micro-batches, so a mean loss gives the mean over the batch.
using PipelineLoss = std::function<at::Tensor(const at::Tensor& output, const at::Tensor& target)>;

// A stage the caller built: its module and its forward (stage_module makes
// one from any module with forward(Tensor) -> Tensor, torch::nn::Sequential
// included).
struct StageModule {
  std::shared_ptr<torch::nn::Module> module;
  std::function<at::Tensor(const at::Tensor&)> forward;
};
template <typename M>
StageModule stage_module(std::shared_ptr<M> m) {
  return {m, [m](const at::Tensor& x) -> at::Tensor { return m->forward(x); }};
}
template <typename Impl>
StageModule stage_module(const torch::nn::ModuleHolder<Impl>& m) {
  return stage_module(m.ptr());
}

namespace detail {
// A parameter held on several pipeline ranks (Note [Tied parameters across stages]).
struct TiedGroup {
  at::Tensor parameter;  // this rank's (undefined where it holds none)
  int owner = 0;  // the rank of the first stage using it
  std::map<int, int> lowest_stage;  // by holding rank: the first stage on it that uses it
};
}  // namespace detail

class Pipeline {
 public:
  Pipeline(torch::nn::Sequential model, comm::CommPtr pp, PipelineLoss loss, PipelineOptions options = {});

  // The stages this rank runs, built by the caller (PyTorch's PipelineStage):
  // for a model too large to build whole on every rank. my_stages[k] is stage
  // rank + k * pp of S = pp x virtual_stages, any module with
  // forward(Tensor) -> Tensor (pp::stage_module(m)); its parameters keep the
  // names it gives them. Parameters shared across stages cannot be found by
  // identity here: declare them with PipelineOptions::tied. split_points do
  // not apply.
  Pipeline(std::vector<StageModule> my_stages, comm::CommPtr pp, PipelineLoss loss, PipelineOptions options = {});

  // This rank's stage (its children of the model, or its one built stage), for
  // the optimizer and data-parallel wrappers: stage->parameters(),
  // dp::replicate(stage.module(), ...). Built stages under virtual stages: the
  // chunks as children "0", "1", ... (use chunks() for their own names).
  torch::nn::Module* operator->() const { return stage_.get(); }
  const std::shared_ptr<torch::nn::Module>& module() const { return stage_; }
  // This rank's chunks, in stage order (one without virtual stages).
  const std::vector<std::shared_ptr<torch::nn::Module>>& chunks() const { return chunks_; }
  // Children [first, last) of the model in this rank's first chunk (-1 for built stages).
  int64_t first_child() const { return bounds_.empty() ? -1 : bounds_[pp_->rank()]; }
  int64_t last_child() const { return bounds_.empty() ? -1 : bounds_[pp_->rank() + 1]; }
  bool is_first() const { return pp_->rank() == 0; }
  bool is_last() const { return pp_->rank() == pp_->size() - 1; }

  // Forward and backward of the whole batch, split along dim 0 into the
  // micro-batches; gradients accumulate in the stage's parameters. `inputs`
  // are read on the first stage and `targets` on the last (other ranks may pass
  // undefined tensors). Returns the batch loss on every rank of the pipeline.
  double step(const at::Tensor& inputs, const at::Tensor& targets);

  // The loss of the batch, forward only (no gradients, no micro-batches: one
  // forward through the stages in order, so pass a batch that fits), on every
  // rank of the pipeline; the tied copies take their owner's value first. For
  // validation between steps (put the modules in eval mode for Dropout and
  // BatchNorm: train::Trainer::evaluate does).
  double evaluate(const at::Tensor& inputs, const at::Tensor& targets);

  // The copies of tied parameters take their owner's value (every rank of the
  // pipeline calls it; step() does it as it starts).
  void sync_tied();
  // The last step's timeline on this rank and the most activations it held.
  const std::vector<TraceEvent>& last_trace() const { return last_.events; }
  int max_activations_in_flight() const { return last_.max_in_flight; }
  // With after_microbatch_backward: the last step's loss of each micro-batch
  // (the loss function's value, before step() divides it), on every rank of
  // the pipeline; empty otherwise.
  const std::vector<double>& microbatch_losses() const { return microbatch_losses_; }
  static constexpr int kTiedTagBase = 1 << 20;
  static constexpr int kEvalTag = kTiedTagBase;  // the tied groups' tags start after it

 private:
  // Note [Tied parameters across stages] (src/pp/pipeline.cpp).
  struct Tied {
    at::Tensor parameter;  // the owner's, or this rank's copy
    int owner = 0;  // the pipeline rank that owns it
    std::vector<int> copies;  // on the owner: the ranks holding a copy
    int last_backward_stage = 0;  // this rank's lowest stage using it (its last backward)
    int tag = 0;
  };
  void start(std::vector<StageFn> fns, const std::vector<detail::TiedGroup>& tied);
  void refresh_tied_copies(std::vector<comm::WorkPtr>& sends);
  void exchange_tied_gradients(int stage, std::vector<comm::WorkPtr>& sends, bool before);
  void share_microbatch_losses(const std::vector<double>& on_last_stage);

  comm::CommPtr pp_;
  PipelineLoss loss_;
  PipelineOptions options_;
  std::vector<int64_t> bounds_;
  std::shared_ptr<torch::nn::Module> stage_;
  std::vector<std::shared_ptr<torch::nn::Module>> chunks_;
  std::unique_ptr<PipelineExecutor> executor_;
  std::vector<StageFn> stage_fns_;  // this rank's, in stage order (evaluate)
  std::vector<Tied> tied_;
  StepResult last_;
  std::vector<double> microbatch_losses_;
  bool shared_by_chunks_ = false;  // a parameter sits in two of this rank's chunks
};

// The children's parameter counts: the costs the balanced split evens out.
std::vector<int64_t> parameter_counts(const torch::nn::SequentialImpl& model);

// The same as constructing a Pipeline, as PyTorch's and torchtitan's helpers read.
inline Pipeline pipeline(torch::nn::Sequential model, comm::CommPtr pp, PipelineLoss loss, PipelineOptions options = {}) {
  return Pipeline(std::move(model), std::move(pp), std::move(loss), std::move(options));
}

}  // namespace pp
}  // namespace meshtrain
