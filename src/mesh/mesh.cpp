#include "meshtrain/mesh.h"

#include "meshtrain/comm.h"
#include "meshtrain/util.h"

namespace meshtrain {
namespace mesh {

namespace {

// A coordinate's field for `axis` (a Coord of degrees gives the axis's degree).
int& index_of(Coord& c, Axis a) {
  switch (a) {
    case Axis::kDp: return c.dp;
    case Axis::kPp: return c.pp;
    case Axis::kTp: return c.tp;
    case Axis::kCp: return c.cp;
  }
  return c.dp;
}

}  // namespace

const char* axis_name(Axis a) {
  switch (a) {
    case Axis::kDp: return "dp";
    case Axis::kPp: return "pp";
    case Axis::kTp: return "tp";
    case Axis::kCp: return "cp";
  }
  return "?";
}

MeshLayout::MeshLayout(int world, const MeshDims& dims)
    : dp_(dims.dp()), pp_(dims.pp()), tp_(dims.tp()), cp_(dims.cp()) {
  const int others = pp_ * tp_ * cp_;
  if (dp_ == 0 && others >= 1 && world % others == 0) dp_ = world / others;  // what the world leaves
  const std::string cp_part = cp_ == 1 ? "" : str_cat(" x cp ", cp_);
  MESHTRAIN_CHECK(dp_ >= 1 && pp_ >= 1 && tp_ >= 1 && cp_ >= 1 && dp_ * pp_ * tp_ * cp_ == world, "mesh layout dp ",
                  dp_, " x pp ", pp_, " x tp ", tp_, cp_part, " = ", dp_ * pp_ * tp_ * cp_,
                  " ranks does not match the world size ", world,
                  "; every degree must be at least 1 and their product must equal the world size (", world,
                  " ranks: choose dp x pp x tp", cp_ == 1 ? "" : " x cp", " = ", world, ")");
}

int MeshLayout::degree(Axis a) const {
  Coord degrees;
  degrees.dp = dp_, degrees.pp = pp_, degrees.tp = tp_, degrees.cp = cp_;
  return index_of(degrees, a);
}

Coord MeshLayout::coord(int rank) const {
  MESHTRAIN_CHECK(rank >= 0 && rank < world(), "rank ", rank, " is outside the mesh of ", world(), " ranks");
  Coord c;
  c.tp = rank % tp_;
  c.cp = (rank / tp_) % cp_;
  c.pp = (rank / (tp_ * cp_)) % pp_;
  c.dp = rank / (tp_ * cp_ * pp_);
  return c;
}

int MeshLayout::rank(const Coord& c) const { return ((c.dp * pp_ + c.pp) * cp_ + c.cp) * tp_ + c.tp; }

std::vector<int> MeshLayout::group(Axis axis, int r) const {
  Coord c = coord(r);
  std::vector<int> out;
  for (int i = 0; i < degree(axis); ++i) {
    Coord k = c;
    index_of(k, axis) = i;
    out.push_back(rank(k));
  }
  return out;
}

std::vector<std::vector<int>> MeshLayout::groups(Axis axis) const {
  std::vector<std::vector<int>> out;
  for (int r = 0; r < world(); ++r) {
    Coord c = coord(r);
    if (index_of(c, axis) == 0) out.push_back(group(axis, r));
  }
  return out;
}

std::vector<int> MeshLayout::dp_cp_group(int r) const {
  std::vector<int> out;
  for (int d : group(Axis::kDp, r))
    for (int k : group(Axis::kCp, d)) out.push_back(k);
  return out;
}

std::string MeshLayout::describe() const {
  return str_cat("dp ", dp_, " x pp ", pp_, " x tp ", tp_, cp_ == 1 ? "" : str_cat(" x cp ", cp_), " = ", world(),
                 " ranks");
}

DeviceMesh::DeviceMesh(comm::CommPtr world, const MeshLayout& layout)
    : world_(std::move(world)), layout_(layout), coord_(layout.coord(world_->rank())) {
  MESHTRAIN_CHECK(world_->size() == layout_.world(), "DeviceMesh: the communicator has ", world_->size(),
                  " ranks but the layout ", layout_.describe());
  const Coord c = coord_;
  const int P = layout_.pp(), T = layout_.tp(), C = layout_.cp();
  // One split per axis: members share the other coordinates (the colour).
  dp_ = world_->split((c.pp * C + c.cp) * T + c.tp, c.dp, "dp");
  pp_ = world_->split((c.dp * C + c.cp) * T + c.tp, c.pp, "pp");
  tp_ = world_->split((c.dp * P + c.pp) * C + c.cp, c.tp, "tp");
  if (C == 1) {
    // No split: cp is this rank alone (a world of one, no collective) and dp x cp is dp.
    cp_ = comm::make_single_process_world();
    dp_cp_ = dp_;
  } else {
    cp_ = world_->split((c.dp * P + c.pp) * T + c.tp, c.cp, "cp");
    dp_cp_ = world_->split(c.pp * T + c.tp, c.dp * C + c.cp, "dp_cp");
  }
}

const comm::CommPtr& DeviceMesh::axis(Axis a) const {
  switch (a) {
    case Axis::kDp: return dp_;
    case Axis::kPp: return pp_;
    case Axis::kTp: return tp_;
    case Axis::kCp: return cp_;
  }
  return dp_;
}

}  // namespace mesh
}  // namespace meshtrain
