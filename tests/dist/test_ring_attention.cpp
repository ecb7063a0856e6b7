// Context parallelism's attention (meshtrain/cp.h) on cp 2, 3 and 4
// ranks: each rank's output and its q, k, v gradients equal its chunks of one
// process's eager attention over the whole sequence (fp64, so any difference
// beyond reassociation shows), with grouped-query heads and chunks that the
// flash tiles do not divide; the bytes each rank sends are the ring's.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "harness.h"
#include "meshtrain/comm.h"
#include "meshtrain/cp.h"
#include "meshtrain/nn.h"

using meshtrain::comm::Communicator;
using meshtrain::testing::run_ranks;
namespace cp = meshtrain::cp;

namespace {

struct Full {
  torch::Tensor q, k, v, dout;
};

Full full_inputs(int64_t B, int64_t H, int64_t KV, int64_t T, int64_t d) {
  torch::manual_seed(42);
  const auto o = torch::TensorOptions().dtype(torch::kDouble);
  return {torch::randn({B, H, T, d}, o) * 2, torch::randn({B, KV, T, d}, o) * 2, torch::randn({B, KV, T, d}, o),
          torch::randn({B, H, T, d}, o)};
}

double max_error(const torch::Tensor& a, const torch::Tensor& b) { return (a - b).abs().max().item<double>(); }

void ring_matches_one_process(Communicator& plain) {
  auto comm = std::shared_ptr<Communicator>(&plain, [](Communicator*) {});
  const int n = comm->size(), r = comm->rank();
  const int64_t B = 2, H = 4, KV = 2, chunk = 5, T = 2 * n * chunk, d = 8;
  const Full full = full_inputs(B, H, KV, T, d);
  // One process: eager attention over the whole sequence.
  const torch::Tensor q = full.q.clone().requires_grad_(), k = full.k.clone().requires_grad_(),
                      v = full.v.clone().requires_grad_();
  const torch::Tensor want = meshtrain::nn::causal_attention(q, k, v);
  want.backward(full.dout);
  // This rank: its chunks, the ring.
  auto mine = [&](const torch::Tensor& t) { return cp::shard_sequence(t, 2, n, r); };
  const torch::Tensor lq = mine(full.q).requires_grad_(), lk = mine(full.k).requires_grad_(),
                      lv = mine(full.v).requires_grad_();
  const auto before = comm->traffic();
  const torch::Tensor got = cp::ring_attention(lq, lk, lv, comm, {4, 3});
  const auto forward = comm->traffic() - before;
  got.backward(mine(full.dout));
  const auto both = comm->traffic() - before;
  const std::string where = "cp " + std::to_string(n) + " rank " + std::to_string(r);
  EXPECT_LE(max_error(got, mine(want.detach())), 1e-10) << where << ": output";
  EXPECT_LE(max_error(lq.grad(), mine(q.grad())), 1e-10) << where << ": dq";
  EXPECT_LE(max_error(lk.grad(), mine(k.grad())), 1e-10) << where << ": dk";
  EXPECT_LE(max_error(lv.grad(), mine(v.grad())), 1e-10) << where << ": dv";
  // Forward: n - 1 hops of this rank's share of k and v; backward: n - 1
  // more, and n hops of their gradients (fp64 here, as the inputs).
  const int64_t kv_bytes = 2 * B * KV * 2 * chunk * d * 8;
  using meshtrain::comm::OpKind;
  EXPECT_EQ(forward[OpKind::kSend].bytes_sent, (n - 1) * kv_bytes) << where;
  EXPECT_EQ(both[OpKind::kSend].bytes_sent, 2 * (n - 1) * kv_bytes + n * kv_bytes) << where;
}

TEST(RingAttention, EveryRanksChunksEqualOneProcessForwardAndBackward) {
  for (int n : {2, 3, 4}) run_ranks(n, ring_matches_one_process);
}

TEST(RingAttention, LayoutIsBalancedAndRoundTrips) {
  // cp 2 over 8 positions: chunks of 2; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2.
  EXPECT_TRUE(torch::equal(cp::local_positions(8, 2, 0), torch::tensor({0, 1, 6, 7}, torch::kLong)));
  EXPECT_TRUE(torch::equal(cp::local_positions(8, 2, 1), torch::tensor({2, 3, 4, 5}, torch::kLong)));
  const torch::Tensor x = torch::arange(24).view({2, 12});
  std::vector<torch::Tensor> parts;
  for (int r = 0; r < 3; ++r) parts.push_back(cp::shard_sequence(x, 1, 3, r));
  EXPECT_TRUE(torch::equal(cp::unshard_sequence(parts, 1), x));
  // The load balance: every rank of cp 4 over 64 positions has the same
  // number of visible (query, key) pairs, sum over its positions p of p + 1.
  for (int r = 0; r < 4; ++r)
    EXPECT_EQ((cp::local_positions(64, 4, r) + 1).sum().item<int64_t>(), 64 * 65 / 2 / 4) << "rank " << r;
  try {
    cp::chunk_layout(10, 3, 0);
    FAIL() << "seq-len 10 accepted for cp 3";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("does not divide --seq-len 10"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("multiple of 6"), std::string::npos) << e.what();
  }
}

}  // namespace
