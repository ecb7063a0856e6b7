#pragma once
// The trainer under an elastic meshrun (meshrun --nnodes MIN:MAX; see
// app/launch/elastic.h): each round may have another world
// size, so the layout is chosen for the world it gets, and the ranks stop at a
// checkpoint when a node waits to join. The global batch never changes: every
// layout trains like one process, so the losses after a node is lost or taken
// in equal the uninterrupted run's (up to float reassociation).

#include <cstdint>
#include <string>
#include <vector>

#include "app/trainer/config.h"

namespace meshtrain {
namespace comm {
class Communicator;
}
namespace train {

// One entry of --elastic-layouts: the layout for a world of `world` ranks.
struct WorldLayout {
  int world = 0;
  int dp = 1, pp = 1, tp = 1;
  int zero = -1;  // -1: the flags' --zero
};

// "4:dp2xpp2,2:dp2,1:dp1" (tokens dpN, ppN, tpN, zeroN joined by x; a degree
// left out is 1). ConfigError naming the entry when malformed, when its
// degrees do not multiply to its world size, or when a world repeats.
std::vector<WorldLayout> parse_elastic_layouts(const std::string& spec);

// How resolve_for_world chose the layout, for the line rank 0 says.
struct LayoutChoice {
  TrainConfig config;  // resolved
  std::string source;  // "the flags", "--elastic-layouts", "the planner"
};

// The resolved configuration for a world of `world` ranks: --elastic-layouts'
// entry for it; else the flags' own layout when it fits; else, when `elastic`
// (an elastic meshrun started this rank), the planner's best layout that fits
// in `rank_memory` bytes and divides the global batch. A layout chosen for
// the world derives its micro-batches itself (--microbatches, --micro-batch
// and --stage-boundaries belong to the flags' layout). ConfigError otherwise.
LayoutChoice resolve_for_world(const TrainConfig& parsed, int world, bool elastic, int64_t rank_memory);

// Collective over `world`: whether a node is waiting to join an elastic job
// (rank 0 asks the store, everyone learns its answer). false, without
// communicating, outside an elastic meshrun.
bool regroup_requested(comm::Communicator& world);

}  // namespace train
}  // namespace meshtrain
