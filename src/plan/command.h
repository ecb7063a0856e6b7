#pragma once
// The command line that runs a planned layout with meshtrain's own launcher
// and trainer:
//   meshrun --nproc-per-node M [--nnodes N --node-rank $NODE_RANK
//     --master-addr $MASTER_ADDR --master-port 29500] -- meshtrain --model ...
// The trainer's flags are the model's shape and the layout, always; the rest
// only where they differ from the trainer's defaults. tests/unit/
// test_plan_command.cpp parses them back with train::parse_train_args.

#include <string>
#include <vector>

#include "meshtrain/plan.h"

namespace meshtrain {
namespace plan {

// The store port the printed command gives meshrun on more than one node (its default).
constexpr int kMasterPort = 29500;

// Why no command can run `input` as planned, or "" when one can: without a
// shape (--params) the trainer has nothing to build; the trainer runs fp32
// and bf16-mixed only.
std::string command_problem(const PlanInput& input);

// The words after `meshtrain` for `estimate`'s layout: --model and the shape,
// --dp --pp --tp --zero, under a pipeline --schedule 1f1b --microbatches K,
// --activation-checkpointing blocks when planned, --precision, the optimizer
// when not Adam, --global-batch and --micro-batch. Requires command_problem()
// to be "".
std::vector<std::string> trainer_args(const PlanInput& input, const Estimate& estimate);

// meshrun's part, up to and including "--": one node, --nproc-per-node
// devices; more, every node's command with $NODE_RANK and $MASTER_ADDR for
// the shell to fill in.
std::string launcher_command(const PlanInput& input);

// The whole line: launcher_command(), "meshtrain", trainer_args().
std::string train_command(const PlanInput& input, const Estimate& estimate);

}  // namespace plan
}  // namespace meshtrain
