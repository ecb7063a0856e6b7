// TcpCommunicator algorithms: what each collective does after its opening
// (Note [Collective skeleton] in collectives.cpp), and the ring and direct
// exchanges they are built from.
//
// Note [Gloo algorithms]
// Per-rank send volume for a buffer of S bytes on n ranks, by size:
//   per-peer payload <= CommOptions::inline_bytes (32 KiB): the data rides in
//     the header round, one round of messages (all_reduce: the whole buffer to
//     every peer, (n-1) S, reduced locally in rank order; on 4..64 ranks, a
//     power of two, the round goes by recursive doubling: Note [Doubling round]);
//   larger: direct (pairwise) algorithms, every pair exchanging at once:
//     reduce_scatter  each rank sends shard q to rank q      (n-1)/n * S
//     all_gather      each rank sends its input to every peer (n-1)/n * S (total)
//     all_reduce      direct reduce-scatter + direct all-gather  2(n-1)/n * S
//   the ring (MESHTRAIN_GLOO_RING_KB: collectives of at least that size) moves
//     the same bytes in n-1 rounds per phase instead of one.
//   broadcast       root sends to each rank                 root: (n-1) * S
//                   from 1 MiB on 3+ ranks: down a chain, in pieces: at most S per rank
//   reduce          each rank sends to root                 S (root receives (n-1) S)
//   gather/scatter  direct to/from root
//   all_to_all      direct pairwise
// Measured on 4 ranks (bench/collectives, docs/comm.md): the direct algorithms
// beat the ring at every size from 64 KiB to 64 MiB (all_reduce 64 KiB: 8.8 vs
// 18 ms on two shared cores, where every round waits for the scheduler; 64 MiB
// 104 vs 108 ms); on 2 ranks the two are the same messages. So the ring is off
// by default; it stays for links where n - 1 concurrent streams into one
// receiver would congest.
// Every reduction combines all its inputs in one reduce_into call, in rank
// order: float16 and bfloat16 accumulate in float32 and round once, as on
// shared memory (the ring's steps, which reduce two at a time, round at each).

#include <ATen/ATen.h>

#include <algorithm>
#include <cstring>

#include "communicator.h"
#include "../reduce.h"
#include "comm/ring.h"
#include "util/shard.h"

namespace meshtrain {
namespace comm {
namespace gloo_backend {

namespace {

// acc := acc op in, elementwise (both contiguous, same dtype and size); kAvg
// sums (summing), and finish_avg() divides once every contribution is in.
void reduce_inplace(at::Tensor acc, const at::Tensor& in, ReduceOp op) {
  reduce_into(acc.data_ptr(), acc.data_ptr(), in.data_ptr(), acc.numel(), acc.scalar_type(), summing(op));
}

void finish_avg(at::Tensor t, ReduceOp op, int n) {
  if (op == ReduceOp::kAvg) t.div_(n);
}

// The address of element `offset` of contiguous `t`. The paths of small
// collectives copy and reduce through raw pointers: an ATen narrow/copy_ costs
// 1-2 us each here (a view's autograd metadata, a TensorIterator), which was
// most of a 64 KiB all-gather's own work on 4 ranks.
char* element_at(const at::Tensor& t, int64_t offset) {
  return static_cast<char*>(t.data_ptr()) + offset * static_cast<int64_t>(t.element_size());
}

// out := piece(0) op piece(1) op ... op piece(n - 1) over `count` elements, in
// rank order, so that every rank, whatever order the pieces arrived in,
// computes the same bits: this rank's piece is `mine`, every other rank's its
// inline payload from the header round. `out` may be `mine`.
void reduce_inline_pieces(void* out, const Round& round, int me, const void* mine, int64_t count,
                          at::ScalarType dtype, ReduceOp op) {
  std::vector<const void*> pieces(round.payload.begin(), round.payload.end());
  pieces[me] = mine;
  reduce_into(out, pieces.data(), static_cast<int>(pieces.size()), count, dtype, summing(op));
}

bool every_rank_inlined(const std::vector<Header>& all) {
  return std::all_of(all.begin(), all.end(), [](const Header& h) { return h.inlined != 0; });
}

}  // namespace

// ---- temporary space

// The view is valid until the next call (which may move the buffer).
at::Tensor TcpCommunicator::scratch(int64_t offset, int64_t numel, const at::Tensor& like) {
  const int64_t elem = like.element_size(), need = (offset + numel) * elem;
  if (!scratch_.defined() || scratch_.numel() < need) {
    scratch_ = at::empty({std::max<int64_t>(need, scratch_.defined() ? 2 * scratch_.numel() : 0)}, at::kByte);
  }
  return at::from_blob(static_cast<char*>(scratch_.data_ptr()) + offset * elem, {numel}, like.options());
}

// ---- each collective's algorithm

void TcpCommunicator::all_reduce_algorithm(Collective& c, ReduceOp op) {
  if (c.small && c.round.folded) {  // reduced by the round itself (Note [Folding round])
    std::memcpy(c.work.data_ptr(), c.round.folded, c.work.nbytes());
  } else if (c.small) {  // everyone has everything: combine in rank order, identically everywhere
    reduce_inline_pieces(c.work.data_ptr(), c.round, rank_, c.work.data_ptr(), c.work.numel(), c.work.scalar_type(), op);
  } else if (use_ring(c.work.nbytes())) {
    ring_all_reduce(c.work.view(-1), op);
  } else if (size() > 1) {
    direct_all_reduce(c.work.view(-1), op);
  }
  finish_avg(c.work, op, size());
}

void TcpCommunicator::broadcast_algorithm(Collective& c, int root) {
  if (c.small) {
    if (rank_ != root && c.work.numel() > 0) std::memcpy(c.work.data_ptr(), c.round.payload[root], c.work.nbytes());
  } else if (c.work.numel() > 0 && use_chain(c.work.nbytes())) {
    broadcast_chain(c.work, root);
  } else if (c.work.numel() > 0 && size() > 1) {
    broadcast_direct(c.work, root);
  }
}

void TcpCommunicator::reduce_algorithm(Collective& c, int root, ReduceOp op) {
  if (rank_ != root) {
    if (!c.small && c.work.numel() > 0) send_and_wait(c.work, root, OpKind::kReduce);
    return;
  }
  if (c.work.numel() == 0) return;
  if (c.small) {
    reduce_inline_pieces(c.work.data_ptr(), c.round, rank_, c.work.data_ptr(), c.work.numel(), c.work.scalar_type(), op);
  } else {
    reduce_received(c.work, root, op);
  }
  finish_avg(c.work, op, size());
}

void TcpCommunicator::reduce_scatter_algorithm(const Collective& c, at::Tensor out,
                                                const std::vector<int64_t>& counts, ReduceOp op) {
  if (c.small) {  // `out` is contiguous (flat_output) and may alias this rank's shard of the input
    const void* mine = element_at(c.work, offsets_of(counts)[rank_]);
    if (c.round.folded) {  // Note [Folding round]
      std::memcpy(out.data_ptr(), c.round.folded, counts[rank_] * c.work.element_size());
    } else if (counts[rank_] > 0) {
      reduce_inline_pieces(out.data_ptr(), c.round, rank_, mine, counts[rank_], c.work.scalar_type(), op);
    }
  } else if (use_ring(c.work.nbytes())) {
    ring_reduce_scatter(c.work, out, counts, op);
  } else {
    direct_reduce_scatter(c.work, out.data_ptr(), counts, op);
  }
  finish_avg(out, op, size());
}

// Into `flat`, every rank's input at its offset: from the header round when
// every rank inlined its input, else by ring or direct messages.
void TcpCommunicator::all_gather_algorithm(const Collective& c, at::Tensor flat,
                                            const std::vector<int64_t>& counts) {
  const auto offsets = offsets_of(counts);
  const size_t elem = flat.element_size();
  // memmove: the input may be this rank's place in the output (ZeRO gathers in place)
  std::memmove(element_at(flat, offsets[rank_]), c.work.data_ptr(), counts[rank_] * elem);
  if (every_rank_inlined(c.round.headers)) {
    for (int r = 0; r < size(); ++r) {
      if (r != rank_ && counts[r] > 0) std::memcpy(element_at(flat, offsets[r]), c.round.payload[r], counts[r] * elem);
    }
  } else if (size() > 1) {
    if (use_ring(flat.nbytes())) {
      ring_all_gather(flat, counts);
    } else {
      direct_all_gather(flat, counts);
    }
  }
}

// Every rank's input in its own shape, each from the header round when its
// sender inlined it, else from a message of its own.
std::vector<at::Tensor> TcpCommunicator::gather_on_root(const Collective& c, int root) {
  std::vector<at::Tensor> pieces(size());
  std::vector<Transfer> ts;
  for (int p = 0; p < size(); ++p) {
    if (p == root) {
      pieces[p] = c.work.clone();
      continue;
    }
    const Header& h = c.round.headers[p];
    pieces[p] = at::empty(shape_of(h), c.work.options());
    if (pieces[p].numel() == 0) continue;
    if (h.inlined) {
      std::memcpy(pieces[p].data_ptr(), c.round.payload[p], pieces[p].nbytes());
    } else {
      ts.push_back(post_recv(pieces[p].data_ptr(), pieces[p].nbytes(), p, collective_slot(0), OpKind::kGather));
    }
  }
  wait_all(ts);
  return pieces;
}

void TcpCommunicator::scatter_algorithm(const Round& round, const std::vector<at::Tensor>& sources, at::Tensor out,
                                         int root) {
  std::vector<Transfer> ts;
  if (rank_ == root) {
    for (int p = 0; p < size(); ++p) {
      if (p == root) {
        out.view(-1).copy_(sources[p].view(-1));
      } else if (sources[p].numel() > 0 && !scatter_inlines(sources[p])) {
        ts.push_back(post_send(sources[p].data_ptr(), sources[p].nbytes(), p, collective_slot(0), OpKind::kScatter));
      }
    }
  } else if (out.numel() > 0) {
    if (round.payload[root]) {
      std::memcpy(out.data_ptr(), round.payload[root], out.nbytes());
    } else {
      ts.push_back(post_recv(out.data_ptr(), out.nbytes(), root, collective_slot(0), OpKind::kScatter));
    }
  }
  wait_all(ts);
}

// Every pair exchanges its tensors at once; `theirs` says what each peer sends.
std::vector<at::Tensor> TcpCommunicator::all_to_all_direct(const std::vector<at::Tensor>& inputs,
                                                            const std::vector<Header>& theirs) {
  std::vector<at::Tensor> received(size());
  std::vector<at::Tensor> sending;  // contiguous inputs, alive until their sends complete
  std::vector<Transfer> ts;
  for (int p = 0; p < size(); ++p) {
    if (p == rank_) {
      received[p] = inputs[p].clone();
      continue;
    }
    received[p] = at::empty(shape_of(theirs[p]), inputs[0].options());
    if (received[p].numel() > 0)
      ts.push_back(post_recv(received[p].data_ptr(), received[p].nbytes(), p, collective_slot(0), OpKind::kAllToAll));
    const at::Tensor src = inputs[p].contiguous();
    sending.push_back(src);
    if (src.numel() > 0) ts.push_back(post_send(src.data_ptr(), src.nbytes(), p, collective_slot(0), OpKind::kAllToAll));
  }
  wait_all(ts);
  return received;
}

// ---- building blocks

// The root's reduce of large buffers: each peer's arrives in a temporary of
// its own, and all are combined into `work` in rank order.
void TcpCommunicator::reduce_received(at::Tensor work, int root, ReduceOp op) {
  std::vector<at::Tensor> parts(size());
  std::vector<const void*> inputs(size());
  std::vector<Transfer> ts;
  for (int p = 0; p < size(); ++p) {
    if (p == root) continue;
    parts[p] = at::empty_like(work);
    inputs[p] = parts[p].data_ptr();
    ts.push_back(post_recv(parts[p].data_ptr(), work.nbytes(), p, collective_slot(0), OpKind::kReduce));
  }
  wait_all(ts);
  inputs[root] = work.data_ptr();
  reduce_into(work.data_ptr(), inputs.data(), size(), work.numel(), work.scalar_type(), summing(op));
}

void TcpCommunicator::broadcast_direct(at::Tensor work, int root) {
  std::vector<Transfer> ts;
  if (rank_ == root) {
    for (int p = 0; p < size(); ++p) {
      if (p != root) ts.push_back(post_send(work.data_ptr(), work.nbytes(), p, collective_slot(0), OpKind::kBroadcast));
    }
  } else {
    ts.push_back(post_recv(work.data_ptr(), work.nbytes(), root, collective_slot(0), OpKind::kBroadcast));
  }
  wait_all(ts);
}

// Note [Broadcast down a chain]
// From 1 MiB on 3+ ranks (MESHTRAIN_GLOO_CHAIN_KB) a broadcast goes from the
// root to the next rank, which forwards each piece as it arrives to the
// next, and so on (OpenMPI's pipeline for large broadcasts). Direct, the root
// sends (n-1) S alone; down the chain no rank sends more than S, and every
// rank both receives and sends, so the copies through the kernel spread over
// every process instead of queueing on the root's share of a core (ranks
// sharing cores) or on its one link (across hosts). Pieces of about 256 KiB,
// 4 to 256 of them: a rank waits one piece before forwarding, and the last
// rank starts (n-2) pieces after the first. Measured on 4 ranks sharing 2
// cores (medians of 3 interleaved runs, ms; direct / chain / OpenMPI TCP /
// PyTorch's Gloo): 64 MiB 176 / 38 / 60 / 66, 16 MiB 29 / 9.3 / 16.7 / 15.3,
// 4 MiB 2.4 / 2.0 / 2.6 / 3.4, 1 MiB 0.61 / 0.56 / 0.49 / 1.42, 256 KiB even.
void TcpCommunicator::broadcast_chain(at::Tensor work, int root) {
  const int n = size(), me = (rank_ - root + n) % n;  // position down the chain
  const int prev = (rank_ + n - 1) % n, next = (rank_ + 1) % n;
  const int64_t pieces = std::min<int64_t>(256, std::max<int64_t>(4, work.nbytes() >> 18));
  const auto counts = shard_sizes(work.numel(), static_cast<int>(pieces));
  const auto offsets = offsets_of(counts);
  const size_t elem = work.element_size();
  char* base = static_cast<char*>(work.data_ptr());
  std::vector<Transfer> in, out;
  for (size_t i = 0; i < counts.size() && me > 0; ++i) {
    if (counts[i] > 0) in.push_back(post_recv(base + offsets[i] * elem, counts[i] * elem, prev, collective_slot(0), OpKind::kBroadcast));
  }
  size_t received = 0;
  for (size_t i = 0; i < counts.size(); ++i) {
    if (counts[i] == 0) continue;
    if (me > 0) wait(in[received++]);
    if (me < n - 1) out.push_back(post_send(base + offsets[i] * elem, counts[i] * elem, next, collective_slot(0), OpKind::kBroadcast));
  }
  wait_all(out);
}

// Note [Pipelined all-reduce]
// The direct all-reduce in pieces of TcpTuning::piece_bytes (MESHTRAIN_GLOO_PIECE_KB,
// 1 MiB): every rank posts its receives at once (each peer's piece j of its
// own shard into scratch, each peer's reduced pieces into place), sends the
// peers' pieces of their shards a window of four ahead, and for each piece of
// its own shard waits for the peers' contributions, reduces it and sends the
// result to every peer at once. The exchange of one piece overlaps the
// reduction of the last and the all-gather of the ones before, and a piece is
// reduced and sent again while the kernel's copies of it are still in cache,
// where the whole reduce-scatter and then the whole all-gather waited for
// each other and read 16 MiB shards back from memory. The same bytes. Measured
// on 4 ranks sharing 2 cores (AMD EPYC, 2026-12-07, medians of 3 interleaved
// runs, ms; pieces of 1 MiB): 16 MiB 23.2 -> 16.5, 64 MiB 83.4 -> 64.4 (OpenMPI
// over TCP 20.3, 82.1); pieces of 2 MiB 18.6 and 57.4, of 64 KiB 17.6 and 75.7;
// on 2 ranks within the noise (64 MiB 23.6 -> 24.2, 16 MiB 6.4 -> 5.5).
void TcpCommunicator::direct_all_reduce(at::Tensor flat, ReduceOp op) {
  const int n = size(), me = rank_;
  const auto counts = shard_sizes(flat.numel(), n);
  const auto offsets = offsets_of(counts);
  const int64_t elem = flat.element_size(), piece = std::max<int64_t>(1, options_.tuning.tcp.piece_bytes / elem);
  constexpr int64_t kWindow = 4;  // pieces of the peers' shards in flight ahead of this rank's reductions
  char* base = static_cast<char*>(flat.data_ptr());
  char* space = static_cast<char*>(scratch(0, n * counts[me], flat).data_ptr());  // peer q's part of my shard at q
  auto pieces_of = [&](int q) { return (counts[q] + piece - 1) / piece; };
  auto elems = [&](int q, int64_t j) { return std::min(piece, counts[q] - j * piece); };
  auto at = [&](int q, int64_t j) { return base + (offsets[q] + j * piece) * elem; };
  auto theirs = [&](int q, int64_t j) { return space + (q * counts[me] + j * piece) * elem; };
  int64_t most = 0;
  for (int q = 0; q < n; ++q) most = std::max(most, pieces_of(q));
  const int64_t mine = pieces_of(me);
  std::vector<std::vector<Transfer>> contributions(mine);  // piece j of my shard from every peer
  std::vector<Transfer> rest;
  for (int q = 0; q < n; ++q) {
    if (q == me) continue;
    for (int64_t j = 0; j < mine; ++j)
      contributions[j].push_back(post_recv(theirs(q, j), elems(me, j) * elem, q, collective_slot(0), OpKind::kAllReduce));
    for (int64_t j = 0; j < pieces_of(q); ++j)
      rest.push_back(post_recv(at(q, j), elems(q, j) * elem, q, collective_slot(1), OpKind::kAllReduce));
  }
  auto send_piece = [&](int64_t j) {  // piece j of every peer's shard, to that peer
    for (int q = 0; q < n; ++q)
      if (q != me && j < pieces_of(q)) rest.push_back(post_send(at(q, j), elems(q, j) * elem, q, collective_slot(0), OpKind::kAllReduce));
  };
  for (int64_t j = 0; j < std::min(kWindow, most); ++j) send_piece(j);
  std::vector<const void*> inputs(n);
  for (int64_t j = 0; j < most; ++j) {
    if (j + kWindow < most) send_piece(j + kWindow);
    if (j >= mine) continue;
    wait_all(contributions[j]);
    for (int q = 0; q < n; ++q) inputs[q] = q == me ? at(me, j) : theirs(q, j);
    reduce_into(at(me, j), inputs.data(), n, elems(me, j), flat.scalar_type(), summing(op));  // rank order
    for (int q = 0; q < n; ++q)
      if (q != me) rest.push_back(post_send(at(me, j), elems(me, j) * elem, q, collective_slot(1), OpKind::kAllReduce));
  }
  wait_all(rest);
}

void TcpCommunicator::ring_step(const at::Tensor& recv, const at::Tensor& send, int sub, OpKind kind) {
  const int right = (rank_ + 1) % size(), left = (rank_ + size() - 1) % size();
  Transfer r, s;
  if (recv.numel() > 0) r = post_recv(recv.data_ptr(), recv.nbytes(), left, collective_slot(sub), kind);
  if (send.numel() > 0) s = post_send(send.data_ptr(), send.nbytes(), right, collective_slot(sub), kind);
  wait(r);
  wait(s);
}

void TcpCommunicator::ring_all_reduce(at::Tensor flat, ReduceOp op) {
  const int n = size();
  if (n == 1 || flat.numel() == 0) return;
  const auto counts = shard_sizes(flat.numel(), n);
  const auto offsets = offsets_of(counts);
  at::Tensor tmp = scratch(0, counts[0], flat);  // counts[0] is the largest
  auto chunk = [&](int c) { return flat.narrow(0, offsets[c], counts[c]); };
  for (int s = 0; s < n - 1; ++s) {  // reduce-scatter phase
    const RingStep st = reduce_scatter_step(rank_, n, s);
    const at::Tensor incoming = tmp.narrow(0, 0, counts[st.recv_chunk]);
    ring_step(incoming, chunk(st.send_chunk), s, OpKind::kAllReduce);
    if (incoming.numel() > 0) reduce_inplace(chunk(st.recv_chunk), incoming, op);
  }
  for (int s = 0; s < n - 1; ++s) {  // all-gather phase
    const RingStep st = all_gather_step(rank_, n, s);
    ring_step(chunk(st.recv_chunk), chunk(st.send_chunk), n + s, OpKind::kAllReduce);
  }
}

void TcpCommunicator::ring_reduce_scatter(const at::Tensor& in, at::Tensor out,
                                           const std::vector<int64_t>& counts, ReduceOp op) {
  const int n = size();
  const auto offsets = offsets_of(counts);
  auto in_chunk = [&](int c) { return in.narrow(0, offsets[c], counts[c]); };
  if (n == 1) {
    out.copy_(in_chunk(0));
    return;
  }
  const int64_t max_count = *std::max_element(counts.begin(), counts.end());
  at::Tensor both = scratch(0, 2 * max_count, in);  // one call: a second could move the buffer
  at::Tensor tmp[2] = {both.narrow(0, 0, max_count), both.narrow(0, max_count, max_count)};
  at::Tensor partial;  // the chunk reduced at the previous step, sent at this one
  for (int s = 0; s < n - 1; ++s) {
    const RingStep st = reduce_scatter_step(rank_, n, s);
    at::Tensor src = s == 0 ? in_chunk(st.send_chunk) : partial;
    // The last step lands in a temporary too: `out` may alias this rank's own
    // input chunk (ZeRO reduces a gradient buffer in place).
    at::Tensor dst = tmp[s % 2].narrow(0, 0, counts[st.recv_chunk]);
    ring_step(dst, src, s, OpKind::kReduceScatter);
    if (dst.numel() > 0) reduce_inplace(dst, in_chunk(st.recv_chunk), op);
    partial = dst;
  }
  out.copy_(partial);
}

void TcpCommunicator::ring_all_gather(at::Tensor flat, const std::vector<int64_t>& counts) {
  const int n = size();
  const auto offsets = offsets_of(counts);
  auto chunk = [&](int c) { return flat.narrow(0, offsets[c], counts[c]); };
  for (int s = 0; s < n - 1; ++s) {
    const RingStep st = all_gather_step(rank_, n, s);
    ring_step(chunk(st.recv_chunk), chunk(st.send_chunk), s, OpKind::kAllGather);
  }
}

void TcpCommunicator::direct_reduce_scatter(const at::Tensor& in, void* out, const std::vector<int64_t>& counts,
                                             ReduceOp op) {
  constexpr OpKind kind = OpKind::kReduceScatter;
  const int n = size(), me = rank_;
  const auto offsets = offsets_of(counts);
  const size_t elem = in.element_size(), shard = counts[me] * elem;
  const char* src = static_cast<const char*>(in.data_ptr());
  char* space = static_cast<char*>(scratch(0, n * counts[me], in).data_ptr());
  std::vector<const void*> inputs(n);  // each rank's contribution to this rank's shard, in rank order
  std::vector<Transfer> ts;
  for (int q = 0; q < n; ++q) {
    if (q == me || counts[me] == 0) continue;
    inputs[q] = space + q * shard;
    ts.push_back(post_recv(space + q * shard, shard, q, collective_slot(0), kind));
  }
  for (int q = 0; q < n; ++q) {
    if (q != me && counts[q] > 0) ts.push_back(post_send(src + offsets[q] * elem, counts[q] * elem, q, collective_slot(0), kind));
  }
  wait_all(ts);
  if (counts[me] == 0) return;
  // `out` may alias this rank's shard of the input (read before written).
  inputs[me] = src + offsets[me] * elem;
  reduce_into(out, inputs.data(), n, counts[me], in.scalar_type(), summing(op));
}

void TcpCommunicator::direct_all_gather(at::Tensor flat, const std::vector<int64_t>& counts) {
  constexpr OpKind kind = OpKind::kAllGather;
  const int n = size(), me = rank_;
  const auto offsets = offsets_of(counts);
  const size_t elem = flat.element_size();
  char* base = static_cast<char*>(flat.data_ptr());
  std::vector<Transfer> ts;
  for (int q = 0; q < n; ++q) {
    if (q == me) continue;
    if (counts[q] > 0) ts.push_back(post_recv(base + offsets[q] * elem, counts[q] * elem, q, collective_slot(0), kind));
    if (counts[me] > 0) ts.push_back(post_send(base + offsets[me] * elem, counts[me] * elem, q, collective_slot(0), kind));
  }
  wait_all(ts);
}

}  // namespace gloo_backend
}  // namespace comm
}  // namespace meshtrain
