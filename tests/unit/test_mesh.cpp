// MeshLayout (pure): rank <-> coordinates with tp innermost, axis groups, validation.

#include <gtest/gtest.h>

#include <set>

#include "meshtrain/mesh.h"
#include "meshtrain/util.h"

using namespace meshtrain;
using namespace meshtrain::mesh;

TEST(MeshLayout, TpInnermostThenPpThenDp) {
  MeshLayout l(8, MeshDims().dp(2).pp(2).tp(2));
  EXPECT_EQ(l.coord(0), (Coord{0, 0, 0}));
  EXPECT_EQ(l.coord(1), (Coord{0, 0, 1}));  // neighbours differ in tp
  EXPECT_EQ(l.coord(2), (Coord{0, 1, 0}));
  EXPECT_EQ(l.coord(5), (Coord{1, 0, 1}));
  for (int r = 0; r < 8; ++r) EXPECT_EQ(l.rank(l.coord(r)), r);
  EXPECT_EQ(l.group(Axis::kTp, 5), (std::vector<int>{4, 5}));
  EXPECT_EQ(l.group(Axis::kPp, 5), (std::vector<int>{5, 7}));
  EXPECT_EQ(l.group(Axis::kDp, 5), (std::vector<int>{1, 5}));
  EXPECT_EQ(l.describe(), "dp 2 x pp 2 x tp 2 = 8 ranks");
}

TEST(MeshLayout, GroupsOfEveryAxisPartitionTheRanks) {
  for (auto dims : std::vector<std::array<int, 3>>{{1, 1, 8}, {2, 4, 1}, {3, 1, 2}, {1, 3, 1}}) {
    MeshLayout l(dims[0] * dims[1] * dims[2], MeshDims().dp(dims[0]).pp(dims[1]).tp(dims[2]));
    for (Axis a : {Axis::kDp, Axis::kPp, Axis::kTp}) {
      std::set<int> seen;
      for (const auto& g : l.groups(a)) {
        EXPECT_EQ(static_cast<int>(g.size()), l.degree(a));
        for (int r : g) EXPECT_TRUE(seen.insert(r).second) << "rank " << r << " in two " << axis_name(a) << " groups";
      }
      EXPECT_EQ(static_cast<int>(seen.size()), l.world());
    }
  }
}

TEST(MeshLayout, ValidationListsEveryDegree) {
  try {
    MeshLayout(8, MeshDims().dp(2).pp(3).tp(2));
    ADD_FAILURE();
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("dp 2 x pp 3 x tp 2 = 12 ranks does not match the world size 8"), std::string::npos) << e.what();
  }
  EXPECT_THROW(MeshLayout(4, MeshDims().dp(-1).pp(2).tp(2)), ConfigError);
  EXPECT_THROW(MeshLayout(6, MeshDims().pp(4)), ConfigError);  // dp 0 takes what is left: 6 / 4 is not whole
  EXPECT_EQ(MeshLayout(8, MeshDims().pp(2).tp(2)).dp(), 2);     // dp 0: what the world leaves
  EXPECT_EQ(MeshLayout(12, MeshDims().tp(2).cp(3)).dp(), 2);
  EXPECT_THROW(MeshLayout(4, MeshDims().dp(2).pp(2)).coord(4), ConfigError);
}

TEST(MeshLayout, CpBetweenTpAndPp) {
  // rank = ((dp * pp + pp_index) * cp + cp_index) * tp + tp_index
  MeshLayout l(16, MeshDims().dp(2).pp(2).tp(2).cp(2));
  Coord c5;  // 5 = ((0 * 2 + 1) * 2 + 0) * 2 + 1: dp 0, pp 1, cp 0, tp 1
  c5.pp = 1;
  c5.tp = 1;
  EXPECT_EQ(l.coord(5), c5);
  Coord c3;  // 3 = ((0 * 2 + 0) * 2 + 1) * 2 + 1: cp 1 sits between tp and pp
  c3.cp = 1;
  c3.tp = 1;
  EXPECT_EQ(l.coord(3), c3);
  for (int r = 0; r < 16; ++r) EXPECT_EQ(l.rank(l.coord(r)), r);
  EXPECT_EQ(l.group(Axis::kCp, 5), (std::vector<int>{5, 7}));
  EXPECT_EQ(l.group(Axis::kTp, 5), (std::vector<int>{4, 5}));
  EXPECT_EQ(l.group(Axis::kPp, 5), (std::vector<int>{1, 5}));
  EXPECT_EQ(l.group(Axis::kDp, 5), (std::vector<int>{5, 13}));
  // The ranks holding the same parameters: same pp and tp, every (dp, cp), in that order.
  EXPECT_EQ(l.dp_cp_group(5), (std::vector<int>{5, 7, 13, 15}));
  EXPECT_EQ(l.describe(), "dp 2 x pp 2 x tp 2 x cp 2 = 16 ranks");
  // cp 1 is not named
  EXPECT_EQ(MeshLayout(8, MeshDims().dp(2).pp(2).tp(2)).describe(), "dp 2 x pp 2 x tp 2 = 8 ranks");
  for (Axis a : {Axis::kDp, Axis::kPp, Axis::kTp, Axis::kCp}) {
    std::set<int> seen;
    for (const auto& g : l.groups(a))
      for (int r : g) EXPECT_TRUE(seen.insert(r).second) << "rank " << r << " in two " << axis_name(a) << " groups";
    EXPECT_EQ(static_cast<int>(seen.size()), 16);
  }
  try {
    MeshLayout(8, MeshDims().dp(2).tp(2).cp(3));
    ADD_FAILURE();
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("dp 2 x pp 1 x tp 2 x cp 3 = 12 ranks"), std::string::npos) << e.what();
  }
}
