// Pure logic of the communication layer, without processes: which backend a
// communicator gets, where the hierarchical backend places its members, the
// shared-memory segment's layout and its measured one-step threshold, the reduction kernels against ATen, and how
// the gloo backend tells a timeout from a broken connection.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <array>
#include <set>

#include "comm/backend.h"
#include "comm/tcp/communicator.h"
#include "comm/header.h"
#include "comm/hier/communicator.h"
#include "comm/reduce.h"
#include "comm/host_profile.h"
#include "comm/shm/layout.h"
#include "comm/shm/one_step.h"
#include "config_error.h"
#include "meshtrain/util.h"

using namespace meshtrain;
using namespace meshtrain::comm;

constexpr auto error_of = meshtrain::testing::config_error_of;

TEST(BackendChoice, AutoPicksSharedMemoryHierarchicalOrGlooFromTheHosts) {
  EXPECT_EQ(choose_impl(BackendKind::kAuto, {"a", "a", "a"}, "world"), Impl::kShm);
  EXPECT_EQ(choose_impl(BackendKind::kAuto, {"a"}, "world"), Impl::kShm);
  EXPECT_EQ(choose_impl(BackendKind::kAuto, {"a", "a", "b", "b"}, "world"), Impl::kHierarchical);
  EXPECT_EQ(choose_impl(BackendKind::kAuto, {"a", "b", "a", "b"}, "world"), Impl::kHierarchical);  // any order
  EXPECT_EQ(choose_impl(BackendKind::kAuto, {"a", "b"}, "dp"), Impl::kGloo);            // one rank per host
  EXPECT_EQ(choose_impl(BackendKind::kAuto, {"a", "a", "b"}, "world"), Impl::kGloo);    // uneven hosts
  EXPECT_EQ(choose_impl(BackendKind::kGloo, {"a", "a"}, "world"), Impl::kGloo);
  EXPECT_EQ(choose_impl(BackendKind::kShm, {"a", "a"}, "world"), Impl::kShm);
}

TEST(BackendChoice, ImpossibleChoicesNameTheFix) {
  const std::string across = error_of([] { choose_impl(BackendKind::kShm, {"a", "b"}, "dp"); });
  EXPECT_NE(across.find("communicator 'dp' spans 2 hosts"), std::string::npos) << across;
  EXPECT_NE(across.find("use backend auto"), std::string::npos) << across;
  const std::string mpi = error_of([] { choose_impl(BackendKind::kMpi, {"a"}, "world"); });
  EXPECT_NE(mpi.find("mpirun"), std::string::npos) << mpi;
  const std::string name = error_of([] { parse_backend("nccl", "MESHTRAIN_BACKEND"); });
  EXPECT_NE(name.find("MESHTRAIN_BACKEND 'nccl' is not a backend; use auto, shm, gloo (also called tcp) or mpi"),
            std::string::npos)
      << name;
  EXPECT_EQ(parse_backend("shm", "--backend"), BackendKind::kShm);
  EXPECT_EQ(parse_backend("tcp", "--backend"), BackendKind::kGloo);  // the TCP backend's own name
  EXPECT_EQ(parse_backend("gloo", "--backend"), BackendKind::kGloo);  // PyTorch's name for it
}

TEST(Hierarchical, PlacementNumbersHostsByFirstMemberAndRanksWithinEach) {
  const auto p = hier_backend::place({"x", "y", "x", "y", "x", "y"});
  EXPECT_EQ(p.hosts, 2);
  EXPECT_EQ(p.host, (std::vector<int>{0, 1, 0, 1, 0, 1}));
  EXPECT_EQ(p.local, (std::vector<int>{0, 0, 1, 1, 2, 2}));
}

TEST(Hierarchical, NestedCollectivesLayTheMembersOutByLocalIndexThenHost) {
  // Hosts interleaved (x y x y x y): local index 0 is members 0 (x) and 1 (y), ...
  EXPECT_EQ(hier_backend::by_local_index(hier_backend::place({"x", "y", "x", "y", "x", "y"})),
            (std::vector<int>{0, 1, 2, 3, 4, 5}));
  // Host-major, as meshrun numbers ranks: 0 1 2 on x, 3 4 5 on y.
  EXPECT_EQ(hier_backend::by_local_index(hier_backend::place({"x", "x", "x", "y", "y", "y"})),
            (std::vector<int>{0, 3, 1, 4, 2, 5}));
  // Hosts numbered by first member: z before a.
  EXPECT_EQ(hier_backend::by_local_index(hier_backend::place({"z", "z", "a", "a"})), (std::vector<int>{0, 2, 1, 3}));
}

TEST(SharedMemoryLayout, RegionsAreAlignedAndDoNotOverlap) {
  for (int n : {1, 2, 3, 8}) {
    shm_backend::SegmentLayout l{n, 256 << 10, 1 << 20};
    std::vector<std::pair<size_t, size_t>> spans;  // [begin, end)
    for (int r = 0; r < n; ++r) {
      spans.push_back({l.ctrl_offset(r), l.ctrl_offset(r) + sizeof(shm_backend::RankCtrl)});
      for (int b = 0; b < shm_backend::SegmentLayout::kBuffersPerRank; ++b) {
        EXPECT_EQ(l.buffer_offset(r, b) % 4096, 0u);
        spans.push_back({l.buffer_offset(r, b), l.buffer_offset(r, b) + l.buffer_bytes});
      }
      for (int q = 0; q < n; ++q) {
        EXPECT_EQ(l.channel_ctrl_offset(r, q) % 64, 0u);
        EXPECT_EQ(l.channel_data_offset(r, q) % 4096, 0u);
        spans.push_back({l.channel_ctrl_offset(r, q), l.channel_ctrl_offset(r, q) + sizeof(shm_backend::ChannelCtrl)});
        spans.push_back({l.channel_data_offset(r, q), l.channel_data_offset(r, q) + l.channel_bytes});
      }
    }
    std::sort(spans.begin(), spans.end());
    EXPECT_GE(spans.front().first, sizeof(shm_backend::SegmentHeader));
    for (size_t i = 1; i < spans.size(); ++i) EXPECT_LE(spans[i - 1].second, spans[i].first) << "n " << n;
    EXPECT_LE(spans.back().second, l.total_bytes());
    EXPECT_EQ(l.region_bytes() % 64, 0u);
    EXPECT_LE(l.region_bytes() * n, l.buffer_bytes);
  }
}

namespace {

// ATen's answer for op over `inputs` in order, accumulated in float for the
// 16-bit types and rounded once (what reduce_into promises).
torch::Tensor reference(const std::vector<torch::Tensor>& inputs, ReduceOp op) {
  const auto dtype = inputs[0].scalar_type();
  const bool narrow = dtype == torch::kBFloat16 || dtype == torch::kHalf;
  auto acc = narrow ? inputs[0].to(torch::kFloat) : inputs[0].clone();
  for (size_t i = 1; i < inputs.size(); ++i) {
    auto x = narrow ? inputs[i].to(torch::kFloat) : inputs[i];
    switch (op) {
      case ReduceOp::kSum: case ReduceOp::kAvg: acc = acc + x; break;
      case ReduceOp::kProduct: acc = acc * x; break;
      case ReduceOp::kMax: acc = torch::maximum(acc, x); break;
      case ReduceOp::kMin: acc = torch::minimum(acc, x); break;
    }
  }
  if (op == ReduceOp::kAvg) acc = acc / static_cast<double>(inputs.size());
  return acc.to(dtype);
}

}  // namespace

TEST(ReduceKernels, EveryDtypeAndOpMatchesATenInRankOrder) {
  torch::manual_seed(3);
  const std::vector<torch::Dtype> dtypes = {torch::kFloat32, torch::kFloat64, torch::kBFloat16, torch::kFloat16,
                                            torch::kInt32,   torch::kInt64,   torch::kInt8,     torch::kUInt8};
  for (auto dtype : dtypes) {
    const bool floating = torch::isFloatingType(dtype);
    for (auto op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kProduct, ReduceOp::kMax, ReduceOp::kMin}) {
      if (op == ReduceOp::kAvg && !floating) continue;
      for (int k : {1, 2, 3, 5}) {
        for (int64_t count : {1, 7, 256, 1000}) {  // around the kernels' block of 256
          std::vector<torch::Tensor> inputs;
          std::vector<const void*> ptrs;
          for (int i = 0; i < k; ++i) {
            auto t = floating ? torch::randn({count}).to(dtype) : torch::randint(-50, 50, {count}).to(dtype);
            inputs.push_back(t);
            ptrs.push_back(t.data_ptr());
          }
          auto out = torch::empty({count}, dtype);
          reduce_into(out.data_ptr(), ptrs.data(), k, count, dtype, op);
          const auto want = reference(inputs, op);
          EXPECT_TRUE(torch::equal(out, want)) << c10::toString(dtype) << " " << reduce_op_name(op) << " k " << k
                                               << " count " << count << "\n got " << out.slice(0, 0, 5)
                                               << "\n want " << want.slice(0, 0, 5);
        }
      }
    }
  }
}

TEST(ReduceKernels, InPlaceNaNAndWrapAround) {
  // out may be the first input.
  auto a = torch::arange(10, torch::kFloat), b = torch::ones({10});
  const void* in[2] = {a.data_ptr(), b.data_ptr()};
  reduce_into(a.data_ptr(), in, 2, 10, torch::kFloat, ReduceOp::kSum);
  EXPECT_TRUE(torch::equal(a, torch::arange(10, torch::kFloat) + 1));
  // NaN wins max and min, as in torch.maximum.
  auto x = torch::tensor({1.0f, std::nanf(""), 3.0f}), y = torch::tensor({std::nanf(""), 2.0f, 1.0f});
  auto out = torch::empty({3});
  const void* xy[2] = {x.data_ptr(), y.data_ptr()};
  for (auto op : {ReduceOp::kMax, ReduceOp::kMin}) {
    reduce_into(out.data_ptr(), xy, 2, 3, torch::kFloat, op);
    EXPECT_TRUE(std::isnan(out[0].item<float>()) && std::isnan(out[1].item<float>())) << reduce_op_name(op);
  }
  // Integer sums wrap as two's complement does.
  auto big = torch::full({2}, std::numeric_limits<int32_t>::max(), torch::kInt), one = torch::ones({2}, torch::kInt);
  const void* wrap[2] = {big.data_ptr(), one.data_ptr()};
  auto sum = torch::empty({2}, torch::kInt);
  reduce_into(sum.data_ptr(), wrap, 2, 2, torch::kInt, ReduceOp::kSum);
  EXPECT_EQ(sum[0].item<int32_t>(), std::numeric_limits<int32_t>::min());
}

// On a group of a larger mesh (a dp or pp communicator), a mismatch names the
// group's ranks and the job's: "rank 1" alone would point at the wrong process.
TEST(Headers, MismatchNamesGroupAndGlobalRanks) {
  using namespace meshtrain::comm;
  const std::vector<Header> all = {header_of(torch::ones({4}), OpKind::kAllReduce),
                                   header_of(torch::ones({4}, torch::kFloat64), OpKind::kAllReduce)};
  EXPECT_EQ(header_mismatch(all, true, {1, 3}),
            "rank 1 (global rank 3) passed Double[4] but rank 0 (global rank 1) passed Float[4]; every rank must pass "
            "the same dtype and shape");
  EXPECT_EQ(header_mismatch(all, true, {0, 1}).rfind("rank 1 passed Double[4] but rank 0 passed Float[4]", 0), 0u);
  EXPECT_EQ(header_mismatch({all[0], all[0]}, true, {1, 3}), "");
  const std::vector<Header> kinds = {all[0], header_of(torch::ones({4}), OpKind::kBroadcast)};
  EXPECT_NE(header_mismatch(kinds, true, {0, 2}).find("rank 1 (global rank 2) called broadcast while rank 0 called"),
            std::string::npos);
}

// Note [Self-tuned waits]: the spin budget is twice the host's measured
// wake-up, within 5-200 us, only where every rank has a core; otherwise waiters
// yield for that long instead (20-200 us).
TEST(SelfTunedWaits, SpinTwiceTheWakeUpWithACorePerRankElseYield) {
  HostProfile host;
  host.wake_us = 18.2;
  WaitTuning own = choose_wait(host, true);
  EXPECT_EQ(own.spin.count(), 36);
  EXPECT_EQ(own.yield.count(), 0);
  EXPECT_NE(own.why.find("18.2 us"), std::string::npos) << own.why;
  WaitTuning shared = choose_wait(host, false);
  EXPECT_EQ(shared.spin.count(), 0);
  EXPECT_EQ(shared.yield.count(), 36);
  host.wake_us = 0.8;
  EXPECT_EQ(choose_wait(host, true).spin.count(), 5);
  EXPECT_EQ(choose_wait(host, false).yield.count(), 20);
  host.wake_us = 900;
  EXPECT_EQ(choose_wait(host, true).spin.count(), 200);
  EXPECT_EQ(choose_wait(host, false).yield.count(), 200);
}

// Note [Link waits on shared cores]: the links spin as shared memory does with
// a core per rank; where ranks share cores they yield 1 ms, whatever the wake-up,
// for messages up to 256 KiB.
TEST(SelfTunedWaits, LinksYieldAMillisecondWhereRanksShareCores) {
  HostProfile host;
  for (double wake : {0.8, 4.5, 18.2, 900.0}) {
    host.wake_us = wake;
    const WaitTuning own = choose_link_wait(host, true), shm_own = choose_wait(host, true);
    EXPECT_EQ(own.spin.count(), shm_own.spin.count()) << wake;
    EXPECT_EQ(own.yield.count(), 0) << wake;
    const WaitTuning shared = choose_link_wait(host, false);
    EXPECT_EQ(shared.spin.count(), 0) << wake;
    EXPECT_EQ(shared.yield.count(), 1000) << wake;
    EXPECT_EQ(shared.large_bytes, 256 << 10) << wake;  // larger messages: what shared memory yields
    EXPECT_EQ(shared.large_yield.count(), choose_wait(host, false).yield.count()) << wake;
    EXPECT_NE(shared.why.find("yield 1000 us (messages over 256 KiB"), std::string::npos) << shared.why;
  }
}

// Note [Link buffers sized to the cache]: the L2 shared by the peers that
// send to a rank at once, within 128 KiB - 4 MiB; unknown L2: the kernel's.
TEST(SelfTunedWaits, LinkBuffersAreTheL2SharedByThePeersOnTheHost) {
  HostProfile host;
  host.l2_bytes = 1 << 20;
  const LinkBuffer one = choose_link_buffer(host, 1);
  EXPECT_EQ(one.bytes, 1 << 20);
  EXPECT_NE(one.why.find("1024 KiB"), std::string::npos) << one.why;
  EXPECT_EQ(choose_link_buffer(host, 3).bytes, (1 << 20) / 3);
  EXPECT_EQ(choose_link_buffer(host, 0).bytes, 1 << 20);    // a rank alone on its host: no division by 0
  EXPECT_EQ(choose_link_buffer(host, 64).bytes, 128 << 10);  // never below 128 KiB
  host.l2_bytes = 32 << 20;
  EXPECT_EQ(choose_link_buffer(host, 1).bytes, 4 << 20);
  host.l2_bytes = 0;
  EXPECT_EQ(choose_link_buffer(host, 1).bytes, 0);
}

TEST(SelfTunedWaits, MeasuringTheHostGivesPositiveFiguresAndTheCacheRepeatsThem) {
  const HostProfile measured = measure_host();
  EXPECT_GT(measured.wake_us, 0.0);
  EXPECT_LT(measured.wake_us, 100000.0);
  EXPECT_GT(measured.copy_gbs, 0.0);
  EXPECT_GE(measured.cores, 1);
  EXPECT_FALSE(measured.cpu.empty());
  const HostProfile& first = host_profile();
  const HostProfile& again = host_profile();
  EXPECT_EQ(&first, &again);  // once per process
  EXPECT_GT(first.wake_us, 0.0);
  EXPECT_NE(describe(first).find("wake-up"), std::string::npos);
}

namespace {
std::vector<shm_backend::OneStepTiming> timings_of(const std::vector<std::array<double, 2>>& us) {
  std::vector<shm_backend::OneStepTiming> t;
  for (size_t i = 0; i < us.size(); ++i) t.push_back({int64_t{4096} << i, us[i][0], us[i][1]});
  return t;
}
}  // namespace

TEST(OneStepThreshold, CandidatesDoubleFrom4KiBUpToTheBufferOr256KiB) {
  using shm_backend::one_step_candidates;
  EXPECT_EQ(one_step_candidates(256 << 10), (std::vector<int64_t>{4096, 8192, 16384, 32768, 65536, 131072, 262144}));
  EXPECT_EQ(one_step_candidates(1 << 20).back(), 256 << 10);
  EXPECT_EQ(one_step_candidates(20 << 10), (std::vector<int64_t>{4096, 8192, 16384}));
  EXPECT_TRUE(one_step_candidates(2 << 10).empty());
}

TEST(OneStepThreshold, TheCrossoverWinsAndOneNoisySizeDoesNotMoveIt) {
  using shm_backend::choose_one_step_bytes;
  // One step faster up to 32 KiB, chunks beyond: the threshold is 32 KiB.
  EXPECT_EQ(choose_one_step_bytes(timings_of({{2, 4}, {3, 5}, {4, 6}, {6, 7}, {10, 8}, {20, 12}, {40, 20}})), 32 << 10);
  // Chunks faster everywhere: the smallest size (below it one step always goes).
  EXPECT_EQ(choose_one_step_bytes(timings_of({{5, 4}, {6, 5}, {8, 6}})), 4 << 10);
  // One step faster everywhere: the largest.
  EXPECT_EQ(choose_one_step_bytes(timings_of({{2, 4}, {3, 5}, {4, 6}})), 16 << 10);
  // 8 KiB measured in a noisy moment (one step 1.2x slower there): still 32 KiB,
  // since moving the threshold below it would lose 1.5x at 16 KiB and 1.17x at 32.
  EXPECT_EQ(choose_one_step_bytes(timings_of({{2, 4}, {6, 5}, {4, 6}, {6, 7}, {10, 8}})), 32 << 10);
  // Each size counts by its relative loss: 10 against 8 moves the threshold down, 10 against 12 does not.
  EXPECT_EQ(choose_one_step_bytes(timings_of({{2, 4}, {10, 8}})), 4 << 10);
  EXPECT_EQ(choose_one_step_bytes(timings_of({{2, 4}, {10, 12}})), 8 << 10);
}

TEST(OneStepThreshold, TheCacheLineRoundTripsAndImplausibleLinesAreRefused) {
  using namespace shm_backend;
  const auto timings = timings_of({{2.25, 4.5}, {3.125, 5}, {4, 6.75}});
  const std::vector<int64_t> sizes{4096, 8192, 16384};
  std::vector<OneStepTiming> back;
  ASSERT_TRUE(parse_timings(format_timings(timings), sizes, back));
  ASSERT_EQ(back.size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(back[i].bytes, timings[i].bytes);
    EXPECT_DOUBLE_EQ(back[i].one_step_us, timings[i].one_step_us);
    EXPECT_DOUBLE_EQ(back[i].chunked_us, timings[i].chunked_us);
  }
  EXPECT_FALSE(parse_timings("", sizes, back));
  EXPECT_FALSE(parse_timings(format_timings(timings), {4096, 8192}, back));               // a line too long
  EXPECT_FALSE(parse_timings(format_timings(timings), {4096, 8192, 16384, 32768}, back));  // too short
  EXPECT_FALSE(parse_timings("4096 2 4 8192 3 5 16384 0 6", sizes, back));                 // a time of 0
  EXPECT_FALSE(parse_timings("4096 2 4 8192 3 5 16384 nan 6", sizes, back));
  EXPECT_FALSE(parse_timings("4096 2 4 9000 3 5 16384 4 6", sizes, back));  // another size
  const std::string line = describe_one_step(8192, 4, timings, true);
  EXPECT_NE(line.find("up to 8 KiB on 4 ranks"), std::string::npos) << line;
  EXPECT_NE(line.find("4K 2.2/4.5"), std::string::npos) << line;
  EXPECT_NE(line.find("(cached)"), std::string::npos) << line;
}
