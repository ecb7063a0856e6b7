// comm::tree_order on every backend (Note [Tree-order sums]): all_reduce,
// reduce_scatter (uneven shards, given output) and reduce add the ranks'
// tensors as the balanced tree over rank index, bit for bit what one process
// computes from the same values, in float32 and bfloat16; the bytes are one
// all_to_all's (and all_gather's); a size that is not a power of two is refused.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "harness.h"
#include "comm/tree_order.h"
#include "meshtrain/util.h"

using meshtrain::comm::Communicator;
using meshtrain::comm::ReduceOp;
using meshtrain::testing::run_ranks;

namespace {

// Rank r's values: magnitudes from 2^-20 to 2^20, so that another order of
// the same additions shows in the last bits.
torch::Tensor values_of(int rank, int64_t numel, torch::Dtype dtype) {
  torch::manual_seed(1000 + rank);
  return (torch::randn({numel}) * torch::pow(2.0, torch::randint(-20, 20, {numel}).to(torch::kFloat))).to(dtype);
}

// What one process computes from every rank's values.
torch::Tensor tree_sum(int n, int64_t numel, torch::Dtype dtype) {
  std::vector<torch::Tensor> all;
  for (int r = 0; r < n; ++r) all.push_back(values_of(r, numel, dtype));
  return meshtrain::comm::sum_in_tree_order(all);
}

void expect_bits(const torch::Tensor& got, const torch::Tensor& want, const std::string& what) {
  ASSERT_EQ(got.numel(), want.numel()) << what;
  EXPECT_TRUE(torch::equal(got.reshape({-1}), want.reshape({-1}))) << what;
}

void sums_follow_the_tree(Communicator& plain) {
  auto comm = meshtrain::comm::tree_order(std::shared_ptr<Communicator>(&plain, [](Communicator*) {}));
  const int n = comm->size(), r = comm->rank();
  for (auto dtype : {torch::kFloat32, torch::kBFloat16}) {
    const int64_t numel = 1001;  // uneven default shards
    const torch::Tensor want = tree_sum(n, numel, dtype);
    torch::Tensor t = values_of(r, numel, dtype);
    comm->all_reduce(t, ReduceOp::kSum);
    expect_bits(t, want, "all_reduce sum");
    t = values_of(r, numel, dtype);
    comm->all_reduce(t, ReduceOp::kAvg);
    expect_bits(t, want / n, "all_reduce avg");  // n a power of two: the division is exact
    // Shards of sizes 0, 1, ... (rank i holds i elements, the last the rest).
    std::vector<int64_t> counts;
    for (int i = 0; i + 1 < n; ++i) counts.push_back(i);
    int64_t offset = 0;
    for (int64_t c : counts) offset += c;
    counts.push_back(numel - offset);
    int64_t mine_at = 0;
    for (int i = 0; i < r; ++i) mine_at += counts[i];
    torch::Tensor out = torch::empty({counts[r]}, dtype);
    const torch::Tensor input = values_of(r, numel, dtype), before = input.clone();
    comm->reduce_scatter_async(input, ReduceOp::kSum, out, counts)->wait();
    expect_bits(out, want.narrow(0, mine_at, counts[r]), "reduce_scatter into output");
    expect_bits(input, before, "reduce_scatter leaves its input");
    t = values_of(r, numel, dtype);
    comm->reduce(t, n - 1, ReduceOp::kSum);
    expect_bits(t, r == n - 1 ? want : values_of(r, numel, dtype), "reduce to the last rank");
  }
  // Max and integer sums are forwarded (any order gives their bits).
  torch::Tensor m = torch::full({3}, static_cast<int64_t>(r));
  comm->all_reduce(m, ReduceOp::kSum);
  EXPECT_EQ(m[0].item<int64_t>(), n * (n - 1) / 2);
}

void bytes_are_one_all_to_all(Communicator& plain) {
  auto comm = meshtrain::comm::tree_order(std::shared_ptr<Communicator>(&plain, [](Communicator*) {}));
  const int n = comm->size();
  comm->reset_traffic();
  torch::Tensor t = torch::ones({4096});
  comm->reduce_scatter(t, ReduceOp::kSum);
  const auto traffic = comm->traffic();
  // Every other rank's shard of 4096 / n float32s leaves this rank once.
  EXPECT_EQ(traffic[meshtrain::comm::OpKind::kAllToAll].bytes_sent, int64_t{4} * 4096 / n * (n - 1));
  EXPECT_EQ(traffic[meshtrain::comm::OpKind::kReduceScatter].bytes_sent, 0);
}

struct Backend {
  const char* name;
  int hosts;
};

class TreeOrder : public ::testing::TestWithParam<Backend> {
 protected:
  meshtrain::testing::RankOptions options() const {
    meshtrain::testing::RankOptions o;
    o.env.push_back(std::string("MESHTRAIN_BACKEND=") + GetParam().name);
    o.hosts = GetParam().hosts;
    return o;
  }
};

TEST_P(TreeOrder, SumsAreTheTreeOverRanksAndCostOneAllToAll) {
  for (int world : {1, 2, 4}) {
    SCOPED_TRACE(std::to_string(world) + " ranks");
    run_ranks(world, [](Communicator& comm) {
      sums_follow_the_tree(comm);
      bytes_are_one_all_to_all(comm);
    }, options());
  }
}

TEST_P(TreeOrder, RefusesASizeThatIsNotAPowerOfTwo) {
  run_ranks(4, [](Communicator& comm) {
    auto three = comm.split(std::vector<int>{0, 1, 2}, "three");
    if (!three) return;
    try {
      meshtrain::comm::tree_order(three);
      ADD_FAILURE() << "a communicator of 3 ranks was taken";
    } catch (const meshtrain::ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("has 3 ranks; sums in tree order need a power of two"), std::string::npos)
          << e.what();
    }
  }, options());
}

INSTANTIATE_TEST_SUITE_P(Backends, TreeOrder,
                         ::testing::Values(Backend{"shm", 1}, Backend{"gloo", 1}, Backend{"auto", 2}, Backend{"mpi", 1}),
                         [](const auto& info) {
                           return std::string(info.param.hosts > 1 ? "hier" : info.param.name);
                         });

}  // namespace
