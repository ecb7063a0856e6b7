// Every collective on world sizes 1-4, every dtype, on every backend and on
// each backend's small-message and large-message paths, checked against
// closed-form values: rank r contributes (r + 1) * base, with base small
// integers so sums, products and averages are exact in every dtype (bfloat16 included).

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <limits>

#include "harness.h"
#include "meshtrain/comm.h"
#include "comm/tree_order.h"
#include "util/shard.h"

// The MPI backend's reading of OpenMPI's eager limit (src/comm/mpi/runtime.h,
// not a public header: declared here to assert that the reading works).
namespace meshtrain::comm::mpi_backend {
int64_t shared_memory_eager_limit();
}

using meshtrain::comm::Communicator;
using meshtrain::comm::OpKind;
using meshtrain::comm::ReduceOp;
using meshtrain::testing::run_ranks;

namespace {

// int8 and uint8 wrap where the closed forms exceed them (the product of
// ranks 1-4 is 16 * 24); the expected values wrap the same way.
const std::vector<torch::Dtype> kDtypes = {torch::kFloat32, torch::kFloat64, torch::kBFloat16, torch::kFloat16,
                                           torch::kInt32,   torch::kInt64,   torch::kInt8,     torch::kUInt8};

// base[i] = 1 + i % m, exact in every dtype for the values used here.
torch::Tensor base(int64_t numel, torch::Dtype dtype, int m = 3) {
  return (torch::arange(numel, torch::kInt64) % m + 1).to(dtype);
}

void expect_equal(const torch::Tensor& got, const torch::Tensor& want, const std::string& what) {
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  ASSERT_EQ(got.scalar_type(), want.scalar_type()) << what;
  EXPECT_TRUE(torch::equal(got, want)) << what << "\n got " << got.to(torch::kDouble).view(-1).slice(0, 0, 8)
                                       << "\n want " << want.to(torch::kDouble).view(-1).slice(0, 0, 8);
}

std::string tag(const char* op, torch::Dtype dt, int64_t numel) {
  return std::string(op) + " dtype=" + c10::toString(dt) + " numel=" + std::to_string(numel);
}

// A backend, a world size, and which path the tensors of these tests take:
// small (gloo: inside the header round; shm: one step) or large (gloo: the
// ring algorithms and the chain broadcast, inline_bytes 0, and gloo_direct:
// the direct ones; shm: the
// chunked algorithms, with buffers so small that the tests' tensors span many
// chunks and rings; hier: the three-phase all_reduce at every size). The MPI
// backend runs the same tests as MpiCollectives (at the end of this file).
struct Case {
  const char* backend;
  int world;
  bool large;
};

void PrintTo(const Case& c, std::ostream* os) {
  *os << c.backend << ", world " << c.world << (c.large ? ", large path" : ", small path");
}

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  return std::string(info.param.backend) + "_world" + std::to_string(info.param.world) +
         (info.param.large ? "_large" : "_small");
}

meshtrain::testing::RankOptions options_for(const Case& c) {
  meshtrain::testing::RankOptions options;
  const std::string backend = c.backend;
  if (backend == "hier") {
    options.env.push_back("MESHTRAIN_BACKEND=auto");
    options.hosts = 2;  // two "hosts" of world / 2 ranks each: the hierarchical backend
    if (c.large) options.env.push_back("MESHTRAIN_HIER_MIN_KB=0");  // every all_reduce takes the hierarchical path
  } else if (backend == "gloo_direct") {
    options.env.push_back("MESHTRAIN_BACKEND=gloo");  // the default algorithms above inline_bytes
    options.env.push_back("MESHTRAIN_GLOO_PIECE_KB=1");  // the pipelined all-reduce in several pieces per shard
  } else {
    options.env.push_back("MESHTRAIN_BACKEND=" + backend);
    if (backend == "gloo" && c.large) {
      options.env.push_back("MESHTRAIN_GLOO_RING_KB=0");   // the ring
      options.env.push_back("MESHTRAIN_GLOO_CHAIN_KB=0");  // broadcasts down the chain
    }
  }
  if (c.large) {
    options.inline_bytes = 0;
    options.env.push_back("MESHTRAIN_SHM_SMALL_KB=0");
    options.env.push_back("MESHTRAIN_SHM_BUFFER_KB=1");
    options.env.push_back("MESHTRAIN_SHM_CHANNEL_KB=1");
  }
  return options;
}

class CollectiveValues : public ::testing::TestWithParam<Case> {
 protected:
  void run(const std::function<void(Communicator&)>& fn) { run_ranks(GetParam().world, fn, options_for(GetParam())); }
};
class Collectives : public CollectiveValues {};
class SmallPayloads : public CollectiveValues {};

void all_reduce_every_op_and_dtype(Communicator& comm) {
  const int n = comm.size(), r = comm.rank();
  const int64_t sum_coef = n * (n + 1) / 2;
  int64_t prod_coef = 1;
  for (int i = 1; i <= n; ++i) prod_coef *= i;
  for (auto dt : kDtypes) {
    for (int64_t numel : {1, 3, 10, 1001}) {  // fewer elements than ranks, uneven chunks
      auto t = base(numel, dt) * (r + 1);
      comm.all_reduce(t, ReduceOp::kSum);
      expect_equal(t, base(numel, dt) * sum_coef, tag("sum", dt, numel));

      t = base(numel, dt) * (r + 1);
      comm.all_reduce(t, ReduceOp::kMax);
      expect_equal(t, base(numel, dt) * n, tag("max", dt, numel));

      t = base(numel, dt) * (r + 1);
      comm.all_reduce(t, ReduceOp::kMin);
      expect_equal(t, base(numel, dt), tag("min", dt, numel));

      t = base(numel, dt, 2) * (r + 1);
      comm.all_reduce(t, ReduceOp::kProduct);
      expect_equal(t, base(numel, dt, 2).pow(n).to(dt) * prod_coef, tag("product", dt, numel));

      if (torch::isFloatingType(dt)) {
        t = base(numel, dt) * (r + 1);
        comm.all_reduce(t, ReduceOp::kAvg);
        auto want = (base(numel, torch::kDouble) * sum_coef / n).to(dt);
        expect_equal(t, want, tag("avg", dt, numel));
      }
    }
    if (torch::isFloatingType(dt)) {
      // max and min propagate NaN as torch does, whichever rank holds it.
      for (int holder : {0, n - 1}) {
        for (ReduceOp op : {ReduceOp::kMax, ReduceOp::kMin}) {
          auto t = base(5, dt) * (r + 1);
          if (r == holder) t[2] = std::numeric_limits<double>::quiet_NaN();
          comm.all_reduce(t, op);
          EXPECT_TRUE(std::isnan(t[2].item<double>())) << tag("NaN through max/min", dt, 5) << " from rank " << holder;
          auto want = base(5, dt) * (op == ReduceOp::kMax ? n : 1);
          expect_equal(t.index({torch::indexing::Slice(3, 5)}), want.slice(0, 3, 5), tag("max/min beside a NaN", dt, 5));
        }
      }
    }
  }
}
TEST_P(CollectiveValues, AllReduceEveryOpAndDtype) { run(all_reduce_every_op_and_dtype); }

void broadcast_and_reduce_from_every_root(Communicator& comm) {
  const int n = comm.size(), r = comm.rank();
  for (auto dt : kDtypes) {
    for (int root = 0; root < n; ++root) {
      auto t = base(17, dt) * (r + 1);
      comm.broadcast(t, root);
      expect_equal(t, base(17, dt) * (root + 1), tag("broadcast", dt, 17));

      t = base(17, dt) * (r + 1);
      comm.reduce(t, root, ReduceOp::kSum);
      auto want = r == root ? base(17, dt) * (n * (n + 1) / 2) : base(17, dt) * (r + 1);
      expect_equal(t, want, tag("reduce", dt, 17));
    }
  }
}
TEST_P(CollectiveValues, BroadcastAndReduceFromEveryRoot) { run(broadcast_and_reduce_from_every_root); }

void all_gather_equal_and_uneven(Communicator& comm) {
  const int n = comm.size(), r = comm.rank();
  for (auto dt : kDtypes) {
    // Equal sizes, as a list and into one flat tensor.
    auto mine = base(6, dt).view({2, 3}) * (r + 1);
    auto list = comm.all_gather(mine);
    ASSERT_EQ(static_cast<int>(list.size()), n);
    for (int p = 0; p < n; ++p) expect_equal(list[p], base(6, dt).view({2, 3}) * (p + 1), tag("all_gather list", dt, 6));
    auto flat = torch::zeros({6 * n}, dt);
    comm.all_gather_into(flat, mine);
    for (int p = 0; p < n; ++p) expect_equal(flat.slice(0, 6 * p, 6 * (p + 1)), base(6, dt) * (p + 1), tag("all_gather_into", dt, 6));
    // Uneven: rank p holds p + 1 elements of shape [p + 1].
    auto uneven = torch::full({r + 1}, r + 1, dt);
    auto parts = comm.all_gather(uneven);
    auto gathered = comm.all_gather_flat(uneven);
    ASSERT_EQ(gathered.numel(), n * (n + 1) / 2);
    // Uneven into a given output (ZeRO's gathers; the hierarchical backend nests these).
    auto into = torch::empty({n * (n + 1) / 2}, dt);
    auto work = comm.all_gather_async(uneven, into);
    work->wait();
    int64_t offset = 0;
    for (int p = 0; p < n; ++p) {
      expect_equal(parts[p], torch::full({p + 1}, p + 1, dt), tag("all_gather uneven", dt, p + 1));
      expect_equal(gathered.slice(0, offset, offset + p + 1), torch::full({p + 1}, p + 1, dt), tag("all_gather_flat", dt, p + 1));
      expect_equal(into.slice(0, offset, offset + p + 1), torch::full({p + 1}, p + 1, dt), tag("all_gather uneven into", dt, p + 1));
      expect_equal(work->result()[1 + p], torch::full({p + 1}, p + 1, dt), tag("all_gather uneven into, part", dt, p + 1));
      offset += p + 1;
    }
  }
}
TEST_P(CollectiveValues, AllGatherEqualAndUneven) { run(all_gather_equal_and_uneven); }

void reduce_scatter_uneven_and_equal(Communicator& comm) {
  const int n = comm.size(), r = comm.rank();
  const int64_t sum_coef = n * (n + 1) / 2;
  for (auto dt : kDtypes) {
    for (int64_t numel : {1, 7, 10, 1003}) {  // not divisible by 2, 3 or 4
      auto in = base(numel, dt) * (r + 1);
      auto shard = comm.reduce_scatter(in, ReduceOp::kSum);
      const auto range = meshtrain::shard_range(numel, n, r);
      expect_equal(shard, (base(numel, dt) * sum_coef).slice(0, range.offset, range.end()), tag("reduce_scatter", dt, numel));
    }
    // Explicit per-rank sizes: rank p gets p + 2 elements.
    std::vector<int64_t> counts;
    int64_t total = 0;
    for (int p = 0; p < n; ++p) { counts.push_back(p + 2); total += p + 2; }
    auto shard = comm.reduce_scatter(base(total, dt) * (r + 1), ReduceOp::kMax, counts);
    const int64_t off = meshtrain::offsets_of(counts)[r];
    expect_equal(shard, (base(total, dt) * n).slice(0, off, off + counts[r]), tag("reduce_scatter counts", dt, total));
    // Equal shards into a given output (torch's reduce_scatter_tensor).
    auto out = torch::empty({5}, dt);
    comm.reduce_scatter_into(out, base(5 * n, dt) * (r + 1));
    expect_equal(out, (base(5 * n, dt) * sum_coef).slice(0, 5 * r, 5 * r + 5), tag("reduce_scatter_into", dt, 5 * n));
  }
}
TEST_P(CollectiveValues, ReduceScatterUnevenAndEqual) { run(reduce_scatter_uneven_and_equal); }

void gather_scatter_all_to_all_barrier(Communicator& comm) {
  const int n = comm.size(), r = comm.rank();
  for (auto dt : kDtypes) {
    const int root = n - 1;
    auto got = comm.gather(torch::full({r + 1, 2}, r, dt), root);
    if (r == root) {
      ASSERT_EQ(static_cast<int>(got.size()), n);
      for (int p = 0; p < n; ++p) expect_equal(got[p], torch::full({p + 1, 2}, p, dt), tag("gather", dt, 2 * (p + 1)));
    } else {
      EXPECT_TRUE(got.empty());
    }
    std::vector<torch::Tensor> inputs;
    if (r == 0) for (int p = 0; p < n; ++p) inputs.push_back(torch::full({p + 1}, 10 + p, dt));
    auto out = torch::zeros({r + 1}, dt);
    comm.scatter(out, inputs, 0);
    expect_equal(out, torch::full({r + 1}, 10 + r, dt), tag("scatter", dt, r + 1));

    // all_to_all: rank r sends (r * 10 + p) repeated p + 1 times to rank p.
    std::vector<torch::Tensor> sends;
    for (int p = 0; p < n; ++p) sends.push_back(torch::full({p + 1}, r * 10 + p, dt));
    auto recvd = comm.all_to_all(sends);
    for (int p = 0; p < n; ++p) expect_equal(recvd[p], torch::full({r + 1}, p * 10 + r, dt), tag("all_to_all", dt, r + 1));

    auto single_in = torch::arange(2 * n, torch::kInt64).to(dt) + 100 * r;
    auto single_out = torch::empty_like(single_in);
    comm.all_to_all_single(single_out, single_in);
    for (int p = 0; p < n; ++p) {
      auto want = (torch::arange(2 * r, 2 * r + 2, torch::kInt64) + 100 * p).to(dt);
      expect_equal(single_out.slice(0, 2 * p, 2 * p + 2), want, tag("all_to_all_single", dt, 2 * n));
    }
  }
  comm.barrier();
}
TEST_P(CollectiveValues, GatherScatterAllToAllBarrier) { run(gather_scatter_all_to_all_barrier); }

void non_contiguous_and_async(Communicator& comm) {
  const int n = comm.size(), r = comm.rank();
  // A transposed view: handled by a contiguous copy written back.
  auto m = (torch::arange(12, torch::kFloat32).view({3, 4}) * (r + 1)).t();
  ASSERT_FALSE(m.is_contiguous());
  comm.all_reduce(m);
  expect_equal(m, torch::arange(12, torch::kFloat32).view({3, 4}).t() * (n * (n + 1) / 2), "non-contiguous all_reduce");
  auto b = (torch::arange(6, torch::kFloat64).view({2, 3}) + r).t();
  comm.broadcast(b, 0);
  expect_equal(b, torch::arange(6, torch::kFloat64).view({2, 3}).t(), "non-contiguous broadcast");
  // Transposed outputs: rank p's piece at [6p, 6p + 6) of the output's logical (row-major) order.
  auto gathered = torch::zeros({3, 2 * n}, torch::kFloat32).t();
  ASSERT_FALSE(gathered.is_contiguous());
  comm.all_gather_into(gathered, torch::arange(6, torch::kFloat32) + 10 * r);
  for (int p = 0; p < n; ++p) {
    expect_equal(gathered.reshape(-1).slice(0, 6 * p, 6 * p + 6), torch::arange(6, torch::kFloat32) + 10 * p,
                 "all_gather into a transposed output");
  }
  auto shard = torch::zeros({3, 2}, torch::kFloat64).t();
  comm.reduce_scatter_into(shard, torch::arange(6 * n, torch::kFloat64) * (r + 1));
  expect_equal(shard.reshape(-1), torch::arange(6 * r, 6 * r + 6, torch::kFloat64) * (n * (n + 1) / 2),
               "reduce_scatter into a transposed output");
  // Several operations in flight, completed in order.
  std::vector<torch::Tensor> ts;
  std::vector<meshtrain::comm::WorkPtr> works;
  for (int i = 0; i < 8; ++i) {
    ts.push_back(torch::full({100 + i}, static_cast<double>(r + i), torch::kFloat64));
    works.push_back(comm.all_reduce_async(ts.back()));
  }
  for (int i = 7; i >= 0; --i) works[i]->wait();  // waiting out of order is fine
  for (int i = 0; i < 8; ++i) {
    const double want = n * (n - 1) / 2.0 + n * i;
    expect_equal(ts[i], torch::full({100 + i}, want, torch::kFloat64), "async all_reduce " + std::to_string(i));
  }
}
TEST_P(Collectives, NonContiguousAndAsync) { run(non_contiguous_and_async); }

void point_to_point_ring_with_tags_and_unknown_shapes(Communicator& comm) {
  const int n = comm.size(), r = comm.rank();
  if (n == 1) return;
  const int right = (r + 1) % n, left = (r + n - 1) % n;
  for (auto dt : kDtypes) {
    // Two tags in flight at once; the receiver takes them in the other order.
    auto a = comm.isend(torch::full({3}, r, dt), right, /*tag=*/1);
    auto b = comm.isend(torch::full({2, 2}, r + 100, dt), right, /*tag=*/2);
    auto got2 = comm.recv_any(left, 2);
    auto got1 = torch::zeros({3}, dt);
    comm.recv(got1, left, 1);
    a->wait();
    b->wait();
    expect_equal(got1, torch::full({3}, left, dt), tag("p2p tag 1", dt, 3));
    expect_equal(got2, torch::full({2, 2}, left + 100, dt), tag("p2p tag 2 (shape unknown)", dt, 4));
  }
  // Messages with one tag arrive in the order sent.
  std::vector<meshtrain::comm::WorkPtr> sends;
  for (int i = 0; i < 5; ++i) sends.push_back(comm.isend(torch::full({1}, i, torch::kInt64), right, 7));
  for (int i = 0; i < 5; ++i) EXPECT_EQ(comm.recv_any(left, 7).item<int64_t>(), i);
  for (auto& s : sends) s->wait();
}
TEST_P(Collectives, PointToPointRingWithTagsAndUnknownShapes) { run(point_to_point_ring_with_tags_and_unknown_shapes); }

// Large messages both ways at once, in several pieces on shm's 1 KiB rings:
// neither side may wait for the other's receive before its own send proceeds.
void large_messages_both_ways_at_once(Communicator& comm) {
  const int n = comm.size(), r = comm.rank();
  if (n == 1) return;
  const int right = (r + 1) % n, left = (r + n - 1) % n;
  const int64_t numel = 300001;  // 1.2 MB
  auto big = torch::arange(numel, torch::kFloat32) + r;
  auto send = comm.isend(big, right, 3);
  auto small = comm.isend(torch::full({5}, r, torch::kInt64), right, 4);
  auto got_small = comm.recv_any(left, 4);  // overtakes the large message from the same sender
  auto got = torch::empty({numel});
  comm.recv(got, left, 3);
  send->wait();
  small->wait();
  expect_equal(got, torch::arange(numel, torch::kFloat32) + left, "large p2p");
  expect_equal(got_small, torch::full({5}, left, torch::kInt64), "small p2p behind a large one");
}
TEST_P(Collectives, LargeMessagesBothWaysAtOnce) { run(large_messages_both_ways_at_once); }

// A receive posted while its message is half read (its frame came in under
// another receive, the rest still arriving) gets the message when it
// completes, though the sender sends nothing more until it is answered (shm
// once left it among the arrived messages and waited for more data: ring
// attention's backward under ZeRO-2/3 hung on it).
void receive_posted_while_its_message_is_half_read(Communicator& comm) {
  if (comm.size() == 1) return;
  const int r = comm.rank();
  const int64_t numel = 300001;  // 1.2 MB: many pieces on shm's rings
  meshtrain::comm::WorkPtr big_send;
  if (r == 1) big_send = comm.isend(torch::arange(numel, torch::kFloat32), 0, 5);  // its frame is written now
  comm.barrier();
  if (r == 0) {
    auto later = torch::zeros({3}, torch::kInt64);
    auto later_recv = comm.irecv(later, 1, 6);  // reads the big message's frame, with no receive for it yet
    auto got = torch::empty({numel});
    comm.recv(got, 1, 5);
    comm.send(torch::ones({1}, torch::kInt64), 1, 7);  // only now does rank 1 send again
    later_recv->wait();
    expect_equal(got, torch::arange(numel, torch::kFloat32), "a message half read when its receive was posted");
    expect_equal(later, torch::full({3}, 6, torch::kInt64), "the message after it");
  } else if (r == 1) {
    big_send->wait();
    comm.recv_any(0, 7);
    comm.send(torch::full({3}, 6, torch::kInt64), 0, 6);
  }
}
TEST_P(Collectives, ReceivePostedWhileItsMessageIsHalfRead) { run(receive_posted_while_its_message_is_half_read); }

// The bytes each algorithm moves, counted exactly: the ring's on gloo; on shm
// what the peers read from this rank (each peer's piece, then this rank's
// reduced piece to every peer); on the hierarchical backend (2 hosts x 2) its
// three phases, of which only the middle one crosses hosts; on mpi, whose
// algorithm is OpenMPI's, the bytes handed to MPI for other ranks and handed
// back from them (Note [MPI traffic]: all_reduce's buffer once each way;
// reduce_scatter's other shards out, this rank's shard in).
void traffic_counts_the_algorithms_bytes(Communicator& comm) {
  const int n = comm.size(), r = comm.rank();
  const std::string backend = comm.backend();
  // Gloo runs the ring only where the test asks for it (MESHTRAIN_GLOO_RING_KB), else the direct algorithms.
  const bool ring = backend == "gloo" && std::getenv("MESHTRAIN_GLOO_RING_KB") && n > 2;
  const bool mpi = backend == "mpi", hier = backend == "hierarchical";
  const int64_t numel = 100003;
  ASSERT_GT(numel * 4, comm.options().inline_bytes);
  auto counts = meshtrain::shard_sizes(numel, n);
  comm.reset_traffic();
  auto t = torch::ones({numel}, torch::kFloat32);
  comm.all_reduce(t);
  auto traffic = comm.traffic();
  // Ring: the reduce-scatter phase sends every chunk but this rank's, the
  // all-gather phase every chunk but the right neighbour's. Hierarchical: the
  // local reduce-scatter (numel - slice), the ring all-reduce of the slice
  // across 2 hosts (slice), the local all-gather (slice).
  const int64_t slice = meshtrain::shard_size(numel, 2, r % 2);
  const int64_t want_sent = n == 1 ? 0
                            : ring ? 4 * ((numel - counts[r]) + (numel - counts[(r + 1) % n]))
                            : mpi  ? 4 * numel
                            : hier ? 4 * (numel + slice)
                                   : 4 * ((numel - counts[r]) + (n - 1) * counts[r]);
  EXPECT_EQ(traffic[OpKind::kAllReduce].calls, 1);
  EXPECT_EQ(traffic[OpKind::kAllReduce].bytes_sent, want_sent);
  EXPECT_EQ(traffic[OpKind::kAllReduce].inter_host_sent, hier ? 4 * slice : 0);
  EXPECT_EQ(traffic[OpKind::kAllReduce].inter_host_received, hier ? 4 * slice : 0);
  if (mpi) {
    EXPECT_EQ(traffic[OpKind::kAllReduce].bytes_received, n == 1 ? 0 : 4 * numel);
  }
  comm.reset_traffic();
  comm.reduce_scatter(t);
  traffic = comm.traffic();
  EXPECT_EQ(traffic[OpKind::kReduceScatter].bytes_sent, n == 1 ? 0 : 4 * (numel - counts[r]));
  // Ring: every chunk but the left neighbour's (the one it sends first); shm,
  // Gloo's direct algorithm: its shard from each peer; mpi: its shard, once.
  // Hierarchical (Note [Nested reduce-scatter and all-gather]): inside the
  // host its local index's slice (its own shard and the other host's
  // member's of the same local index) from its host-mate, then its shard from
  // the other host; only that part crosses, its slice less its shard going out.
  const int64_t local_slice = counts[r % 2] + counts[r % 2 + 2];  // ranks 0-1 on one host, 2-3 on the other
  EXPECT_EQ(traffic[OpKind::kReduceScatter].bytes_received,
            n == 1  ? 0
            : ring  ? 4 * (numel - counts[(r + n - 1) % n])
            : mpi   ? 4 * counts[r]
            : hier  ? 4 * (local_slice + counts[r])
                    : 4 * counts[r] * (n - 1));
  if (hier) {
    EXPECT_EQ(traffic[OpKind::kReduceScatter].inter_host_sent, 4 * (local_slice - counts[r]));
    EXPECT_EQ(traffic[OpKind::kReduceScatter].inter_host_received, 4 * counts[r]);
  }
  if (r == 0) std::cout << traffic.table("reduce_scatter traffic");
}
TEST_P(Collectives, TrafficCountsTheAlgorithmsBytes) { run(traffic_counts_the_algorithms_bytes); }

// On mpi, the counting rule of Note [MPI traffic] instead: whatever OpenMPI's
// small-message algorithm, the buffer counts once each way, and the
// verification all-gather sends this rank's 120-byte header and receives
// every peer's.
void small_payloads_travel_in_one_round(Communicator& comm) {
  const int n = comm.size(), r = comm.rank();
  const bool mpi = comm.backend() == "mpi";
  // Gloo's header round on 4 ranks goes by recursive doubling (Note [Doubling
  // round]); so does the hierarchical backend's for small payloads, which
  // travel on its Gloo communicator of every rank.
  const bool doubling = (comm.backend() == "gloo" || comm.backend() == "hierarchical") && n == 4;
  const int64_t numel = 1003;  // 4012 bytes: inline
  auto counts = meshtrain::shard_sizes(numel, n);
  comm.reset_traffic();
  auto t = torch::ones({numel});
  comm.all_reduce(t);
  auto traffic = comm.traffic();
  if (mpi) {
    EXPECT_EQ(traffic[OpKind::kAllReduce].bytes_sent, n == 1 ? 0 : 4 * numel);
    EXPECT_EQ(traffic[OpKind::kAllReduce].bytes_received, n == 1 ? 0 : 4 * numel);
    EXPECT_EQ(traffic[OpKind::kVerify].bytes_sent, n == 1 ? 0 : 120);
    EXPECT_EQ(traffic[OpKind::kVerify].bytes_received, 120 * (n - 1));
  } else {
    // The whole buffer to each peer; by doubling, folded (Note [Folding
    // round]), one buffer per step: this rank's, then its pair's sum.
    EXPECT_EQ(traffic[OpKind::kAllReduce].bytes_sent, 4 * numel * (doubling ? 2 : n - 1));
    // Only the headers remain under "verify": one per peer each way, or by
    // doubling every header the sender knows, each way alike.
    EXPECT_EQ(traffic[OpKind::kVerify].bytes_sent, traffic[OpKind::kVerify].bytes_received);
    if (!doubling) {
      EXPECT_EQ(traffic[OpKind::kVerify].bytes_sent % (n == 1 ? 1 : n - 1), 0);
    }
  }
  comm.reset_traffic();
  comm.reduce_scatter(t);
  traffic = comm.traffic();
  // Each peer gets only its shard: the ring's volume, in one round (mpi: the
  // same bytes leave this rank; its shard arrives, counted once). By doubling
  // on 4 ranks, folded: first this rank's shards for its partner p = r ^ 1
  // and for p ^ 2, then its pair's sum for r ^ 2 (the same bytes leave); in,
  // p's shards for r and r ^ 2, then one sum for r.
  const int64_t sent = numel - counts[r];
  const int64_t received = n == 1 ? 0 : doubling ? 2 * counts[r] + counts[r ^ 2] : counts[r] * (mpi ? 1 : n - 1);
  EXPECT_EQ(traffic[OpKind::kReduceScatter].bytes_sent, 4 * sent);
  EXPECT_EQ(traffic[OpKind::kReduceScatter].bytes_received, 4 * received);
}
TEST_P(SmallPayloads, TravelInOneRound) { run(small_payloads_travel_in_one_round); }

// Gloo's small all_reduce and reduce_scatter on 4 and 8 ranks reduce within
// the doubling round (Note [Folding round]): the balanced tree's sum over rank
// index, bit for bit what comm::sum_in_tree_order computes in one process,
// the same bits on every rank; avg divides that sum; bfloat16 keeps the
// rank-order sum, rounded once.
torch::Tensor folding_values(int rank, int64_t numel, torch::Dtype dtype) {
  torch::manual_seed(2000 + rank);  // magnitudes 2^-20 .. 2^20: another order shows in the last bits
  return (torch::randn({numel}) * torch::pow(2.0, torch::randint(-20, 20, {numel}).to(torch::kFloat))).to(dtype);
}

void small_sums_fold_in_tree_order(Communicator& comm) {
  const int n = comm.size(), r = comm.rank();
  const int64_t numel = 1003;  // inline, shards of 250 and 251 elements
  for (auto dtype : {torch::kFloat, torch::kDouble}) {
    std::vector<torch::Tensor> all;
    for (int o = 0; o < n; ++o) all.push_back(folding_values(o, numel, dtype));
    const auto tree = meshtrain::comm::sum_in_tree_order(all);
    auto t = folding_values(r, numel, dtype);
    comm.all_reduce(t);
    EXPECT_TRUE(torch::equal(t, tree)) << "all_reduce, " << dtype;
    auto avg = folding_values(r, numel, dtype);
    comm.all_reduce(avg, ReduceOp::kAvg);
    EXPECT_TRUE(torch::equal(avg, tree / n)) << "avg, " << dtype;
    const auto counts = meshtrain::shard_sizes(numel, n);
    int64_t offset = 0;
    for (int o = 0; o < r; ++o) offset += counts[o];
    auto shard = comm.reduce_scatter(folding_values(r, numel, dtype), ReduceOp::kSum, counts);
    EXPECT_TRUE(torch::equal(shard, tree.narrow(0, offset, counts[r]))) << "reduce_scatter, " << dtype;
    // Shards of nothing beside others (every even rank's; every rank's but
    // the last, all starting where it starts): empty byte ranges, which must
    // neither be sent nor taken for one payload for all.
    const auto odd = meshtrain::shard_sizes(numel, n / 2);
    std::vector<int64_t> odd_only(n, 0), last_only(n, 0);
    for (int o = 1; o < n; o += 2) odd_only[o] = odd[o / 2];
    last_only[n - 1] = numel;
    for (const auto& gaps : {odd_only, last_only}) {
      int64_t gap_offset = 0;
      for (int o = 0; o < r; ++o) gap_offset += gaps[o];
      auto gapped = comm.reduce_scatter(folding_values(r, numel, dtype), ReduceOp::kSum, gaps);
      EXPECT_TRUE(torch::equal(gapped, tree.narrow(0, gap_offset, gaps[r]))) << "empty shards, " << dtype;
    }
  }
  // bfloat16: every rank's values added in rank order in float32, rounded
  // once; a sum rounded at every step of the tree differs in some elements.
  auto bf16_of = [&](int o) { return (folding_values(o, numel, torch::kFloat) / 1024).to(torch::kBFloat16); };
  auto exact = torch::zeros({numel});
  for (int o = 0; o < n; ++o) exact += bf16_of(o).to(torch::kFloat);
  auto b = bf16_of(r);
  comm.all_reduce(b);
  EXPECT_TRUE(torch::equal(b, exact.to(torch::kBFloat16))) << "bfloat16";
}

class FoldingRound : public CollectiveValues {};
TEST_P(FoldingRound, SmallSumsFollowTheTree) { run(small_sums_fold_in_tree_order); }
INSTANTIATE_TEST_SUITE_P(Doubling, FoldingRound, ::testing::Values(Case{"gloo", 4, false}, Case{"gloo", 8, false}),
                         case_name);

// Sizes around the MPI round's split (a message of header + payload larger
// than OpenMPI's eager size, less 128 bytes, goes in two where the rest fits
// it too: Note [MPI header round]; with the default 4,096 the split starts at
// 3,849 payload bytes, float64 481/482, float32 962/963, and ends at 7,816)
// and up to inline_bytes: every element is rank- and position-dependent, so a
// misplaced part shows.
void payloads_across_the_round_split(Communicator& comm) {
  const int n = comm.size(), r = comm.rank();
  for (int64_t numel : {300, 481, 482, 900, 962, 963, 990, 1000, 1005, 1020, 1040, 2000, 4000, 8192}) {
    const auto mine = torch::arange(numel, torch::kFloat64) + 1e5 * r;
    auto sum = mine.clone();
    comm.all_reduce(sum);
    expect_equal(sum, torch::arange(numel, torch::kFloat64) * n + 1e5 * (n * (n - 1) / 2), tag("all_reduce", torch::kFloat64, numel));
    auto b = mine.to(torch::kFloat32);
    comm.broadcast(b, static_cast<int>(numel % n));
    expect_equal(b, (torch::arange(numel, torch::kFloat64) + 1e5 * (numel % n)).to(torch::kFloat32), tag("broadcast", torch::kFloat32, numel));
    auto gathered = comm.all_gather_flat(mine.to(torch::kFloat32));
    for (int p = 0; p < n; ++p) {
      expect_equal(gathered.slice(0, p * numel, (p + 1) * numel),
                   (torch::arange(numel, torch::kFloat64) + 1e5 * p).to(torch::kFloat32), tag("all_gather", torch::kFloat32, numel));
    }
    const auto everyone = torch::arange(numel * n, torch::kFloat64) + 1e5 * r;
    auto shard = comm.reduce_scatter(everyone);
    expect_equal(shard, torch::arange(numel * r, numel * (r + 1), torch::kFloat64) * n + 1e5 * (n * (n - 1) / 2),
                 tag("reduce_scatter", torch::kFloat64, numel * n));
    // In place, as ZeRO does: the output is this rank's shard of the input.
    auto in = everyone.clone();
    comm.reduce_scatter_into(in.narrow(0, numel * r, numel), in);
    expect_equal(in.narrow(0, numel * r, numel), shard, tag("reduce_scatter in place", torch::kFloat64, numel * n));
    if (n == 1) continue;
    // Point to point, the same sizes (Note [MPI messages]): two in flight per pair, one into a
    // given tensor, one of a shape the receiver learns from the message.
    const int right = (r + 1) % n, left = (r + n - 1) % n;
    auto a = comm.isend(mine, right, 3);
    auto c = comm.isend(mine.view({1, -1}).to(torch::kFloat32), right, 4);
    auto got = torch::zeros({numel}, torch::kFloat64);
    comm.recv(got, left, 3);
    auto any = comm.recv_any(left, 4);
    a->wait();
    c->wait();
    const auto theirs = torch::arange(numel, torch::kFloat64) + 1e5 * left;
    expect_equal(got, theirs, tag("send/recv", torch::kFloat64, numel));
    expect_equal(any, theirs.view({1, -1}).to(torch::kFloat32), tag("send/recv_any", torch::kFloat32, numel));
  }
  if (n == 1) return;
  // Messages of every kind on one (source, tag), in order: split (4,800 and
  // 5,600 bytes), a payload of its own (40,000 bytes: beyond inline_bytes),
  // whole (400); the first receive posted before anything was sent.
  const int right = (r + 1) % n, left = (r + n - 1) % n;
  auto first = torch::zeros({600}, torch::kFloat64);
  auto early = comm.irecv(first, left, 5);
  comm.barrier();
  const std::vector<torch::Tensor> sent = {torch::arange(600, torch::kFloat64) + r, torch::arange(10000, torch::kFloat32) + r,
                                           torch::arange(100, torch::kFloat32) + r, torch::arange(700, torch::kFloat64) + r};
  std::vector<meshtrain::comm::WorkPtr> sends;
  for (const auto& t : sent) sends.push_back(comm.isend(t, right, 5));
  auto second = torch::zeros({10000}, torch::kFloat32);
  comm.recv(second, left, 5);
  auto third = comm.recv_any(left, 5);
  auto fourth = comm.recv_any(left, 5);
  early->wait();
  for (auto& w : sends) w->wait();
  expect_equal(first, torch::arange(600, torch::kFloat64) + left, "one tag: split, posted early");
  expect_equal(second, torch::arange(10000, torch::kFloat32) + left, "one tag: a payload of its own");
  expect_equal(third, torch::arange(100, torch::kFloat32) + left, "one tag: whole");
  expect_equal(fourth, torch::arange(700, torch::kFloat64) + left, "one tag: split, shape learnt");
}

std::vector<Case> every_case(bool large) {
  std::vector<Case> cases;
  for (const char* backend : {"shm", "gloo"}) {
    for (int world = 1; world <= 4; ++world) {
      if (!large || world > 1) cases.push_back({backend, world, large});
    }
  }
  cases.push_back({"hier", 4, large});  // 2 hosts x 2 ranks
  // Gloo's large path is the ring above (MESHTRAIN_GLOO_RING_KB=0); its
  // default above inline_bytes, the direct algorithms, differ from it from 3 ranks on.
  if (large) cases.push_back({"gloo_direct", 3, large});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Small, CollectiveValues, ::testing::ValuesIn(every_case(false)), case_name);
INSTANTIATE_TEST_SUITE_P(Large, CollectiveValues, ::testing::ValuesIn(every_case(true)), case_name);
INSTANTIATE_TEST_SUITE_P(Small, Collectives, ::testing::ValuesIn(every_case(false)), case_name);
INSTANTIATE_TEST_SUITE_P(Large, Collectives, ::testing::ValuesIn(every_case(true)), case_name);
INSTANTIATE_TEST_SUITE_P(Small, SmallPayloads, ::testing::ValuesIn(every_case(false)), case_name);
// 8 ranks: the doubling header round's three steps (Note [Doubling round]), 4 covering two.
INSTANTIATE_TEST_SUITE_P(Doubling, CollectiveValues, ::testing::Values(Case{"gloo", 8, false}), case_name);

// The MPI backend runs every test above, at every world size, in one mpirun
// job per world size: a job costs ~1 s to start (mpirun, then libtorch's
// start-up in every rank, which the zygote cannot spare ranks that mpirun
// starts), so a job per test would add a minute to the suite (measured: 64 s
// for the ten tests at worlds 1-4). Two paths: payloads up to inline_bytes
// ride in the header round (Note [MPI header round]); with inline_bytes 0
// (the "large" jobs) every collective is OpenMPI's own (which picks its
// algorithms by size itself).
class MpiCollectives : public ::testing::TestWithParam<Case> {};

TEST_P(MpiCollectives, EveryTestInOneJob) {
  const std::vector<std::pair<const char*, void (*)(Communicator&)>> tests = {
      {"AllReduceEveryOpAndDtype", all_reduce_every_op_and_dtype},
      {"BroadcastAndReduceFromEveryRoot", broadcast_and_reduce_from_every_root},
      {"AllGatherEqualAndUneven", all_gather_equal_and_uneven},
      {"ReduceScatterUnevenAndEqual", reduce_scatter_uneven_and_equal},
      {"GatherScatterAllToAllBarrier", gather_scatter_all_to_all_barrier},
      {"NonContiguousAndAsync", non_contiguous_and_async},
      {"PointToPointRingWithTagsAndUnknownShapes", point_to_point_ring_with_tags_and_unknown_shapes},
      {"LargeMessagesBothWaysAtOnce", large_messages_both_ways_at_once},
      {"ReceivePostedWhileItsMessageIsHalfRead", receive_posted_while_its_message_is_half_read},
      {"TrafficCountsTheAlgorithmsBytes", traffic_counts_the_algorithms_bytes},
      {"SmallPayloadsTravelInOneRound", small_payloads_travel_in_one_round},
      {"PayloadsAcrossTheRoundSplit", payloads_across_the_round_split},
  };
  meshtrain::testing::RankOptions options;
  options.env.push_back("MESHTRAIN_BACKEND=mpi");
  if (GetParam().large) options.inline_bytes = 0;
  // One job splits messages at another size than OpenMPI's (1,400 - 128: from 1,153 payload bytes).
  const bool other_split = !GetParam().large && GetParam().world == 3;
  if (other_split) options.env.push_back("MESHTRAIN_MPI_EAGER_BYTES=1400");
  run_ranks(GetParam().world, [&](Communicator& comm) {
    // The others split where OpenMPI's tool interface says (4,096 bytes on Debian's OpenMPI 4.1;
    // a rank alone has no shared-memory transport, and nothing to split).
    if (!other_split && comm.size() > 1) {
      EXPECT_GE(meshtrain::comm::mpi_backend::shared_memory_eager_limit(), 4096);
    }
    for (const auto& test : tests) {
      SCOPED_TRACE(test.first);
      test.second(comm);
    }
  }, options);
}

INSTANTIATE_TEST_SUITE_P(Worlds, MpiCollectives,
                         ::testing::Values(Case{"mpi", 1, false}, Case{"mpi", 2, false}, Case{"mpi", 3, false},
                                           Case{"mpi", 4, false}, Case{"mpi", 2, true}, Case{"mpi", 3, true},
                                           Case{"mpi", 4, true}),
                         case_name);

}  // namespace
