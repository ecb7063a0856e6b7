#include "meshtrain/mesh/mesh.h"

#include "meshtrain/util/error.h"

namespace meshtrain {
namespace mesh {

const char* axis_name(Axis a) {
  switch (a) {
    case Axis::kDp: return "dp";
    case Axis::kPp: return "pp";
    case Axis::kTp: return "tp";
  }
  return "?";
}

MeshLayout::MeshLayout(int world, int dp, int pp, int tp) : dp_(dp), pp_(pp), tp_(tp) {
  MESHTRAIN_CHECK(dp >= 1 && pp >= 1 && tp >= 1 && dp * pp * tp == world, "mesh layout dp ", dp, " x pp ", pp,
                  " x tp ", tp, " = ", dp * pp * tp, " ranks does not match the world size ", world,
                  "; every degree must be at least 1 and their product must equal the world size (",
                  world, " ranks: choose dp x pp x tp = ", world, ")");
}

int MeshLayout::degree(Axis a) const { return a == Axis::kDp ? dp_ : a == Axis::kPp ? pp_ : tp_; }

Coord MeshLayout::coord(int rank) const {
  MESHTRAIN_CHECK(rank >= 0 && rank < world(), "rank ", rank, " is outside the mesh of ", world(), " ranks");
  return Coord{rank / (pp_ * tp_), (rank / tp_) % pp_, rank % tp_};
}

int MeshLayout::rank(const Coord& c) const { return (c.dp * pp_ + c.pp) * tp_ + c.tp; }

std::vector<int> MeshLayout::group(Axis axis, int r) const {
  Coord c = coord(r);
  std::vector<int> out;
  for (int i = 0; i < degree(axis); ++i) {
    Coord k = c;
    (axis == Axis::kDp ? k.dp : axis == Axis::kPp ? k.pp : k.tp) = i;
    out.push_back(rank(k));
  }
  return out;
}

std::vector<std::vector<int>> MeshLayout::groups(Axis axis) const {
  std::vector<std::vector<int>> out;
  for (int r = 0; r < world(); ++r) {
    const Coord c = coord(r);
    if ((axis == Axis::kDp ? c.dp : axis == Axis::kPp ? c.pp : c.tp) == 0) out.push_back(group(axis, r));
  }
  return out;
}

std::string MeshLayout::describe() const {
  return str_cat("dp ", dp_, " x pp ", pp_, " x tp ", tp_, " = ", world(), " ranks");
}

DeviceMesh::DeviceMesh(comm::CommPtr world, const MeshLayout& layout)
    : world_(std::move(world)), layout_(layout), coord_(layout.coord(world_->rank())) {
  MESHTRAIN_CHECK(world_->size() == layout_.world(), "DeviceMesh: the communicator has ", world_->size(),
                  " ranks but the layout ", layout_.describe());
  const Coord c = coord_;
  // One split per axis: members share the other two coordinates.
  dp_ = world_->split(c.pp * layout_.tp() + c.tp, c.dp, "dp");
  pp_ = world_->split(c.dp * layout_.tp() + c.tp, c.pp, "pp");
  tp_ = world_->split(c.dp * layout_.pp() + c.pp, c.tp, "tp");
}

const comm::CommPtr& DeviceMesh::axis(Axis a) const { return a == Axis::kDp ? dp_ : a == Axis::kPp ? pp_ : tp_; }

}  // namespace mesh
}  // namespace meshtrain
