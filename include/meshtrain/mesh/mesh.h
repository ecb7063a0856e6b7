#pragma once
// The device mesh over (dp, pp, tp). MeshLayout is pure: rank <-> coordinates
// and every axis's rank lists, with tp innermost (neighbouring ranks, the same
// node, where the traffic is heaviest), then pp, then dp:
//   rank = (dp_index * pp + pp_index) * tp + tp_index
// DeviceMesh adds one communicator per axis group; strategies receive their
// axis's communicator, nothing is global.

#include <string>
#include <vector>

#include "meshtrain/comm/communicator.h"

namespace meshtrain {
namespace mesh {

enum class Axis { kDp, kPp, kTp };
const char* axis_name(Axis a);

struct Coord {
  int dp = 0, pp = 0, tp = 0;
  bool operator==(const Coord& o) const { return dp == o.dp && pp == o.pp && tp == o.tp; }
};

class MeshLayout {
 public:
  // Throws ConfigError listing every degree when dp x pp x tp != world or a degree is < 1.
  MeshLayout(int world, int dp, int pp, int tp);
  int dp() const { return dp_; }
  int pp() const { return pp_; }
  int tp() const { return tp_; }
  int world() const { return dp_ * pp_ * tp_; }
  int degree(Axis a) const;
  Coord coord(int rank) const;
  int rank(const Coord& c) const;
  // The ranks of `rank`'s group along `axis`, in axis order.
  std::vector<int> group(Axis axis, int rank) const;
  // Every group along `axis`.
  std::vector<std::vector<int>> groups(Axis axis) const;
  std::string describe() const;  // "dp 2 x pp 2 x tp 2 = 8 ranks"

 private:
  int dp_, pp_, tp_;
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

 private:
  comm::CommPtr world_, dp_, pp_, tp_;
  MeshLayout layout_;
  Coord coord_;
};

}  // namespace mesh
}  // namespace meshtrain
