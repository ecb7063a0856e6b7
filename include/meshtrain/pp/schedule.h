#pragma once
// Pipeline schedules as data (pure). A model is cut into S = ranks x V stages
// (V virtual stages, "chunks", per rank for interleaving); stage s runs on rank
// s % ranks as its chunk s / ranks. A schedule is, per rank, the list of actions
// it executes in order: forward or backward of a micro-batch on a stage, and the
// sends and receives of activations (forward) and their gradients (backward).
// Printed as "1F3" (stage 1, forward, micro-batch 3), "1B3", "send 1F3>2",
// "recv 0F3<0" ... One executor (executor.h) runs any of them.
//
//   naive        the article's model parallelism: one micro-batch at a time,
//                forward through all stages then backward (bubble (p-1)/p)
//   gpipe        all forwards, then all backwards (holds m micro-batches)
//   1f1b         PipeDream-flush: p-r-1 warm-up forwards on rank r, then one
//                forward / one backward (holds at most p micro-batches)
//   interleaved  Megatron's interleaved 1F1B with V chunks per rank (bubble
//                divided by V); needs micro-batches divisible by the ranks

#include <cstdint>
#include <string>
#include <vector>

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
// balance loss, models/moe_balance.h).
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

}  // namespace pp
}  // namespace meshtrain
