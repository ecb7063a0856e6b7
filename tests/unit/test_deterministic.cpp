// Pure logic of deterministic training (issue 33): the exact sum of squares
// behind its gradient norm, the tree-order communicator's sum, the strided
// grain assignment, and what --deterministic resolves and refuses.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "comm/tree_order.h"
#include "dp/grain_tree.h"
#include "app/trainer/config.h"
#include "meshtrain/util.h"
#include "util/exact_sum.h"
#include "config_error.h"

using namespace meshtrain;

namespace {

double exact_norm_sq(const std::vector<at::Tensor>& parts) {
  ExactSquareSum s;
  for (const auto& p : parts) s.add_squares(p);
  return s.value();
}

// Values that make float sums reassociate: magnitudes from 2^-140 (subnormal
// squares' neighbours) to 2^60, signs mixed.
at::Tensor wild_values(int64_t n, uint64_t seed) {
  torch::manual_seed(seed);
  const at::Tensor exponents = torch::randint(-140, 60, {n}).to(at::kFloat);
  return torch::randn({n}) * torch::pow(2.0, exponents);
}

}  // namespace

// Note [Exact sum of squares]: sums of integers' squares are exact (closed
// form), and any split of the elements, in any order, merged through the
// digits as an all-reduce adds them, gives the same double, where float64
// running sums of the same squares differ by order.
TEST(ExactSquareSum, IsExactAndTheSameForAnySplitAndOrder) {
  const int64_t n = 3000;
  EXPECT_EQ(exact_norm_sq({torch::arange(1, n + 1).to(at::kFloat)}), static_cast<double>(n * (n + 1) * (2 * n + 1) / 6));
  EXPECT_EQ(exact_norm_sq({torch::full({5}, 0.5f), torch::full({3}, -0.25f)}), 5 * 0.25 + 3 * 0.0625);
  const float tiny = std::numeric_limits<float>::denorm_min();
  EXPECT_EQ(exact_norm_sq({torch::full({4}, tiny)}), std::ldexp(1.0, -296));  // four squares of 2^-149: 2^-298 each

  const at::Tensor v = wild_values(20000, 3);
  const double whole = exact_norm_sq({v});
  bool running_sums_differ = false;
  const double forward = (v.to(at::kDouble) * v.to(at::kDouble)).cumsum(0)[-1].item<double>();
  for (int parts : {2, 3, 7, 64}) {
    const at::Tensor shuffled = v.index_select(0, torch::randperm(v.numel()));
    std::vector<ExactSquareSum> ranks(parts);
    for (int r = 0; r < parts; ++r) ranks[r].add_squares(shuffled.chunk(parts)[r]);
    at::Tensor digits = ranks[0].digits();
    for (int r = 1; r < parts; ++r) digits += ranks[r].digits();  // what the all-reduce of int64s adds
    EXPECT_EQ(ExactSquareSum::from_digits(digits).value(), whole) << parts << " parts";
    const double reordered = (shuffled.to(at::kDouble) * shuffled.to(at::kDouble)).cumsum(0)[-1].item<double>();
    running_sums_differ = running_sums_differ || reordered != forward;
  }
  EXPECT_TRUE(running_sums_differ);  // what the exact sum prevents
  EXPECT_NEAR(whole, forward, 1e-12 * whole);  // the same sum, up to float64 rounding
}

TEST(ExactSquareSum, WidensBf16ExactlyAndReportsNonFiniteValues) {
  const at::Tensor v = wild_values(500, 5).to(at::kBFloat16);
  EXPECT_EQ(exact_norm_sq({v}), exact_norm_sq({v.to(at::kFloat)}));
  EXPECT_TRUE(std::isinf(exact_norm_sq({torch::tensor({1.0f, std::numeric_limits<float>::infinity()})})));
  EXPECT_TRUE(std::isnan(exact_norm_sq({torch::tensor({std::nanf(""), std::numeric_limits<float>::infinity()})})));
  ExactSquareSum s;
  EXPECT_THROW(s.add_squares(torch::ones({2}, at::kDouble)), ConfigError);
}

// Note [Tree-order sums]: the communicator's sum over n ranks is the grain
// tree's combination of n subtrees, bit for bit.
TEST(TreeOrderSum, IsTheGrainTreeOverRanks) {
  for (int n = 1; n <= 64; n *= 2) {
    std::vector<at::Tensor> pieces, copies;
    for (int r = 0; r < n; ++r) {
      pieces.push_back(wild_values(777, 100 + r));
      copies.push_back(pieces.back().clone());
    }
    EXPECT_TRUE(torch::equal(comm::sum_in_tree_order(pieces), dp::combine_in_tree_order(copies))) << n << " ranks";
  }
  EXPECT_THROW(comm::sum_in_tree_order({torch::ones({2}), torch::ones({2}), torch::ones({2})}), ConfigError);
}

// Rank r's micro-batch j is grain j * dp + r: the dp grains of one micro-step
// are an aligned block of the tree, and every grain is someone's.
TEST(GrainIndex, StridesTheGrainsOverTheRanks) {
  for (int dp_size : {1, 2, 4, 8}) {
    std::vector<int> seen(16, 0);
    for (int r = 0; r < dp_size; ++r)
      for (int j = 0; j < 16 / dp_size; ++j) ++seen[dp::grain_index(j, r, dp_size)];
    for (int g = 0; g < 16; ++g) EXPECT_EQ(seen[g], 1) << "grain " << g << " dp " << dp_size;
  }
  EXPECT_EQ(dp::grain_index(3, 1, 4), 13);
}

namespace {

std::string error_of(const std::vector<std::string>& args, int world) {
  return meshtrain::testing::config_error_of([&] { train::resolve(train::parse_train_args(args), world); });
}

bool has(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

}  // namespace

TEST(TrainConfig, DeterministicDerivesTheGrainsAndRefusesWhatItCannotMakeExact) {
  auto c = train::resolve(train::parse_train_args({"--deterministic", "--global-batch", "24"}), 2);
  EXPECT_EQ(c.grains, 8);  // the largest power of two dividing 24, up to 8: the same on every dp
  EXPECT_EQ(c.micro_batch, 3);
  EXPECT_EQ(train::accumulation_steps(c), 4);
  c = train::resolve(train::parse_train_args({"--deterministic", "--global-batch", "12", "--pp", "2"}), 4);
  EXPECT_EQ(c.grains, 4);
  EXPECT_EQ(c.microbatches, 2);  // grains / dp
  c = train::resolve(train::parse_train_args({"--deterministic", "--global-batch", "64", "--grains", "32"}), 8);
  EXPECT_EQ(c.micro_batch, 2);
  const std::vector<std::string> det = {"--deterministic", "--global-batch", "24"};
  auto with = [&](std::vector<std::string> more) {
    more.insert(more.begin(), det.begin(), det.end());
    return more;
  };
  EXPECT_TRUE(has(error_of(with({"--tp", "2"}), 2), "--deterministic with --tp 2"));
  EXPECT_TRUE(has(error_of(with({"--strategy", "dp"}), 2), "use --strategy ddp"));
  EXPECT_TRUE(has(error_of(with({}), 3), "--deterministic with dp 3"));
  EXPECT_TRUE(has(error_of(with({"--grains", "6"}), 2), "--grains 6 must be a power of two"));
  EXPECT_TRUE(has(error_of(with({"--grains", "16"}), 2), "dividing --global-batch 24"));
  EXPECT_TRUE(has(error_of({"--deterministic", "--global-batch", "32"}, 16), "divisible by dp 16"));  // give --grains 16
  EXPECT_TRUE(has(error_of(with({"--micro-batch", "6"}), 2), "--micro-batch 6 differs"));
  EXPECT_TRUE(has(error_of(with({"--precision", "bf16-mixed", "--reduce-dtype", "fp32"}), 2), "use --reduce-dtype bf16"));
  EXPECT_TRUE(has(error_of(with({"--deterministic-threads", "0"}), 1), "--deterministic-threads 0"));
  EXPECT_TRUE(has(error_of({"--grains", "8"}, 1), "--grains applies to --deterministic"));
}
