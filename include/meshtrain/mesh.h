#pragma once
// meshtrain/mesh.h: the device mesh: named degrees, coordinates, one communicator per axis.
// Part of the public API (meshtrain/meshtrain.h includes it); the sections below
// are in dependency order.

#include <torch/arg.h>

#include <string>
#include <vector>

#include "meshtrain/comm.h"

// ===== mesh =====
// The device mesh over (dp, pp, cp, tp). MeshLayout is pure: rank <->
// coordinates and every axis's rank lists, with tp innermost (neighbouring
// ranks, the same node, where the traffic is heaviest), then cp (the ring's
// keys and values every block), then pp, then dp:
//   rank = ((dp_index * pp + pp_index) * cp + cp_index) * tp + tp_index
// DeviceMesh adds one communicator per axis group, and one over dp x cp: the
// ranks that hold the same parameters (context parallelism splits the
// sequence, not the model, so its ranks reduce gradients and shard ZeRO's
// state with the data-parallel ones, as torchtitan's FSDP over dp x cp).
// Strategies receive their axis's communicator, nothing is global.

namespace meshtrain {
namespace mesh {

enum class Axis { kDp, kPp, kTp, kCp };
const char* axis_name(Axis a);

struct Coord {
  int dp = 0, pp = 0, tp = 0, cp = 0;
  bool operator==(const Coord& o) const { return dp == o.dp && pp == o.pp && tp == o.tp && cp == o.cp; }
};

// The degree of each axis, by name (torchtitan's ParallelDims), never by
// position: MeshLayout(8, MeshDims().dp(2).pp(2).tp(2)). dp 0 takes what the
// world leaves, world / (pp x cp x tp).
struct MeshDims {
  TORCH_ARG(int, dp) = 0;
  TORCH_ARG(int, pp) = 1;
  TORCH_ARG(int, cp) = 1;
  TORCH_ARG(int, tp) = 1;
};

class MeshLayout {
 public:
  // Throws ConfigError listing every degree when dp x pp x cp x tp != world
  // or a degree is < 1 (dp 0: what the others leave, when they divide world).
  MeshLayout(int world, const MeshDims& dims);
  int dp() const { return dp_; }
  int pp() const { return pp_; }
  int tp() const { return tp_; }
  int cp() const { return cp_; }
  int world() const { return dp_ * pp_ * cp_ * tp_; }
  int degree(Axis a) const;
  Coord coord(int rank) const;
  int rank(const Coord& c) const;
  // The ranks of `rank`'s group along `axis`, in axis order.
  std::vector<int> group(Axis axis, int rank) const;
  // Every group along `axis`.
  std::vector<std::vector<int>> groups(Axis axis) const;
  // The ranks holding the same parameters as `rank` (same pp and tp), in
  // (dp, cp) order: index dp_index * cp + cp_index.
  std::vector<int> dp_cp_group(int rank) const;
  std::string describe() const;  // "dp 2 x pp 2 x tp 2 = 8 ranks" (" x cp 2" when cp > 1)

 private:
  int dp_, pp_, tp_, cp_;
};

class DeviceMesh {
 public:
  // Collective over `world`: every rank calls it.
  DeviceMesh(comm::CommPtr world, const MeshLayout& layout);
  const MeshLayout& layout() const { return layout_; }
  Coord coord() const { return coord_; }
  const comm::CommPtr& world() const { return world_; }
  const comm::CommPtr& axis(Axis a) const;
  const comm::CommPtr& dp() const { return dp_; }
  const comm::CommPtr& pp() const { return pp_; }
  const comm::CommPtr& tp() const { return tp_; }
  const comm::CommPtr& cp() const { return cp_; }
  // The ranks holding the same parameters: dp x cp (dp itself when cp is 1).
  // Gradients are averaged and ZeRO's state sharded over it.
  const comm::CommPtr& dp_cp() const { return dp_cp_; }

 private:
  comm::CommPtr world_, dp_, pp_, tp_, cp_, dp_cp_;
  MeshLayout layout_;
  Coord coord_;
};

}  // namespace mesh
}  // namespace meshtrain
