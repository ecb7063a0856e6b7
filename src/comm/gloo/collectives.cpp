// GlooCommunicator collectives: the header exchange that verifies arguments
// across ranks, and the algorithms.
//
// Note [Gloo algorithms]
// Per-rank send volume for a buffer of S bytes on n ranks, by size:
//   per-peer payload <= CommOptions::inline_bytes (32 KiB): the data rides in
//     the header round, one round of messages (all_reduce: the whole buffer to
//     every peer, (n-1) S, reduced locally in rank order);
//   larger: direct (pairwise) algorithms, every pair exchanging at once:
//     reduce_scatter  each rank sends shard q to rank q      (n-1)/n * S
//     all_gather      each rank sends its input to every peer (n-1)/n * S (total)
//     all_reduce      direct reduce-scatter + direct all-gather  2(n-1)/n * S
//   the ring (MESHTRAIN_GLOO_RING_KB: collectives of at least that size) moves
//     the same bytes in n-1 rounds per phase instead of one.
//   broadcast       root sends to each rank                 root: (n-1) * S
//   reduce          each rank sends to root                 S (root receives (n-1) S)
//   gather/scatter  direct to/from root
//   all_to_all      direct pairwise
// Measured on 4 ranks (bench/collectives, docs/comm.md): the direct algorithms
// beat the ring at every size from 64 KiB to 64 MiB (all_reduce 64 KiB: 8.8 vs
// 18 ms on two shared cores, where every round waits for the scheduler; 64 MiB
// 104 vs 108 ms); on 2 ranks the two are the same messages. So the ring is off
// by default; it stays for links where n - 1 concurrent streams into one
// receiver would congest.

#include <ATen/ATen.h>

#include <algorithm>
#include <cstring>

#include "communicator.h"
#include "meshtrain/comm/errors.h"
#include "../reduce.h"
#include "meshtrain/comm/ring.h"
#include "meshtrain/util/error.h"
#include "meshtrain/util/shard.h"

namespace meshtrain {
namespace comm {
namespace gloo_backend {

namespace {

constexpr int kHeaderSub = 0xffff;

// acc := acc op in, elementwise (both contiguous, same dtype and size).
void reduce_inplace(at::Tensor acc, const at::Tensor& in, ReduceOp op) {
  reduce_into(acc.data_ptr(), acc.data_ptr(), in.data_ptr(), acc.numel(), acc.scalar_type(),
              op == ReduceOp::kAvg ? ReduceOp::kSum : op);
}

void finish_avg(at::Tensor t, ReduceOp op, int n) {
  if (op == ReduceOp::kAvg) t.div_(n);
}

at::Tensor contiguous_flat(const at::Tensor& t) { return t.contiguous().view(-1); }

}  // namespace

// ---- the header round

// Note [Header round]
// Every collective that verifies its arguments, or whose payload is small,
// starts with one round in which each rank sends every peer a fixed-size
// Header, followed in the same message by an inline payload when it fits
// (CommOptions::inline_bytes). Receivers always post buffers of header +
// inline_bytes, so a peer with different arguments can never overflow them (a
// larger-than-posted message would crash gloo's event loop); the headers are
// then compared on every rank, and all raise the same MismatchError. For small
// payloads this round *is* the collective (one round instead of a ring's
// 2(n-1) steps); the data is then combined locally in rank order, which gives
// bit-identical results on every rank.

Round GlooCommunicator::header_round(const Header& mine,
                                     const std::function<const at::Tensor*(int)>& inline_for) {
  const int n = size();
  const int64_t capacity = static_cast<int64_t>(sizeof(Header)) + options_.inline_bytes;
  if (static_cast<int>(round_recv_.size()) != n) {
    round_recv_.assign(n, at::Tensor());
    round_send_.assign(n, at::Tensor());
    for (int p = 0; p < n; ++p) {
      if (p == rank_) continue;
      round_recv_[p] = at::empty({capacity}, at::kByte);
      round_send_[p] = at::empty({capacity}, at::kByte);
    }
  }
  Round round;
  round.headers.assign(n, Header());
  round.headers[rank_] = mine;
  round.payload.assign(n, nullptr);
  std::vector<Transfer> transfers;
  std::vector<int64_t> inline_sent(n, 0);
  for (int p = 0; p < n; ++p) {
    if (p == rank_) continue;
    transfers.push_back(post_recv(round_recv_[p].data_ptr(), capacity, p, collective_slot(kHeaderSub), OpKind::kVerify));
    Header h = mine;
    const at::Tensor* data = inline_for ? inline_for(p) : nullptr;
    h.inline_bytes = data ? static_cast<int64_t>(data->nbytes()) : 0;
    uint8_t* out = round_send_[p].data_ptr<uint8_t>();
    std::memcpy(out, &h, sizeof(Header));
    if (h.inline_bytes > 0) std::memcpy(out + sizeof(Header), data->data_ptr(), h.inline_bytes);
    inline_sent[p] = h.inline_bytes;
    transfers.push_back(post_send(out, sizeof(Header) + h.inline_bytes, p, collective_slot(kHeaderSub), OpKind::kVerify));
  }
  for (auto& t : transfers) wait(t);
  const OpKind kind = static_cast<OpKind>(mine.kind);
  for (int p = 0; p < n; ++p) {
    if (p == rank_) continue;
    const uint8_t* in = round_recv_[p].data_ptr<uint8_t>();
    std::memcpy(&round.headers[p], in, sizeof(Header));
    const Header& h = round.headers[p];
    if (h.magic != Header().magic || h.inline_bytes < 0 || h.inline_bytes > options_.inline_bytes) {
      throw CommError(str_cat(where("verify"), ": malformed header from ", peer_name(p)));
    }
    if (h.inline_bytes > 0) round.payload[p] = in + sizeof(Header);
    // wait() counted the posted capacity; count what arrived, and the inline
    // payload as the operation's data rather than verification.
    count(OpKind::kVerify, p, -inline_sent[p], static_cast<int64_t>(sizeof(Header)) - capacity);
    count(kind, p, inline_sent[p], h.inline_bytes);
  }
  return round;
}

std::vector<Header> GlooCommunicator::exchange_headers(const Header& mine) {
  return header_round(mine, nullptr).headers;
}

void GlooCommunicator::verify_same(const std::vector<Header>& all, const char* op, bool same_shape) const {
  const std::string problem = header_mismatch(all, same_shape);
  if (!problem.empty()) throw MismatchError(str_cat(where(op), ": ", problem));
}

// ---- algorithms

// The view is valid until the next call (which may move the buffer).
at::Tensor GlooCommunicator::scratch(int64_t offset, int64_t numel, const at::Tensor& like) {
  const int64_t elem = like.element_size(), need = (offset + numel) * elem;
  if (!scratch_.defined() || scratch_.numel() < need) {
    scratch_ = at::empty({std::max<int64_t>(need, scratch_.defined() ? 2 * scratch_.numel() : 0)}, at::kByte);
  }
  return at::from_blob(static_cast<char*>(scratch_.data_ptr()) + offset * elem, {numel}, like.options());
}

void GlooCommunicator::ring_all_reduce(at::Tensor flat, ReduceOp op) {
  const int n = size();
  if (n == 1 || flat.numel() == 0) return;
  const auto counts = shard_sizes(flat.numel(), n);
  const auto offsets = offsets_of(counts);
  const size_t elem = flat.element_size();
  const int right = (rank_ + 1) % n, left = (rank_ + n - 1) % n;
  at::Tensor tmp = scratch(0, counts[0], flat);  // counts[0] is the largest
  auto chunk = [&](int c) { return flat.narrow(0, offsets[c], counts[c]); };
  for (int s = 0; s < n - 1; ++s) {  // reduce-scatter phase
    const RingStep st = reduce_scatter_step(rank_, n, s);
    Transfer recv, send;
    if (counts[st.recv_chunk] > 0)
      recv = post_recv(tmp.data_ptr(), counts[st.recv_chunk] * elem, left, collective_slot(s), OpKind::kAllReduce);
    if (counts[st.send_chunk] > 0)
      send = post_send(chunk(st.send_chunk).data_ptr(), counts[st.send_chunk] * elem, right, collective_slot(s), OpKind::kAllReduce);
    wait(recv);
    wait(send);
    if (counts[st.recv_chunk] > 0) reduce_inplace(chunk(st.recv_chunk), tmp.narrow(0, 0, counts[st.recv_chunk]), op);
  }
  for (int s = 0; s < n - 1; ++s) {  // all-gather phase
    const RingStep st = all_gather_step(rank_, n, s);
    Transfer recv, send;
    if (counts[st.recv_chunk] > 0)
      recv = post_recv(chunk(st.recv_chunk).data_ptr(), counts[st.recv_chunk] * elem, left, collective_slot(n + s), OpKind::kAllReduce);
    if (counts[st.send_chunk] > 0)
      send = post_send(chunk(st.send_chunk).data_ptr(), counts[st.send_chunk] * elem, right, collective_slot(n + s), OpKind::kAllReduce);
    wait(recv);
    wait(send);
  }
}

void GlooCommunicator::ring_reduce_scatter(const at::Tensor& in, at::Tensor out,
                                           const std::vector<int64_t>& counts, ReduceOp op) {
  const int n = size();
  const auto offsets = offsets_of(counts);
  auto in_chunk = [&](int c) { return in.narrow(0, offsets[c], counts[c]); };
  if (n == 1) {
    out.copy_(in_chunk(0));
    return;
  }
  const size_t elem = in.element_size();
  const int right = (rank_ + 1) % n, left = (rank_ + n - 1) % n;
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
    Transfer recv, send;
    if (dst.numel() > 0)
      recv = post_recv(dst.data_ptr(), dst.numel() * elem, left, collective_slot(s), OpKind::kReduceScatter);
    if (src.numel() > 0)
      send = post_send(src.data_ptr(), src.numel() * elem, right, collective_slot(s), OpKind::kReduceScatter);
    wait(recv);
    wait(send);
    if (dst.numel() > 0) reduce_inplace(dst, in_chunk(st.recv_chunk), op);
    partial = dst;
  }
  out.copy_(partial);
}

void GlooCommunicator::direct_reduce_scatter(const at::Tensor& in, at::Tensor out, const std::vector<int64_t>& counts,
                                             ReduceOp op, OpKind kind, int sub) {
  const int n = size(), me = rank_;
  const auto offsets = offsets_of(counts);
  const size_t elem = in.element_size();
  const char* src = static_cast<const char*>(in.data_ptr());
  std::vector<at::Tensor> parts(n);  // each peer's contribution to this rank's shard
  const at::Tensor space = scratch(0, n * counts[me], in);
  std::vector<Transfer> ts;
  for (int q = 0; q < n; ++q) {
    if (q == me || counts[me] == 0) continue;
    parts[q] = space.narrow(0, q * counts[me], counts[me]);
    ts.push_back(post_recv(parts[q].data_ptr(), counts[me] * elem, q, collective_slot(sub), kind));
  }
  for (int q = 0; q < n; ++q) {
    if (q != me && counts[q] > 0) ts.push_back(post_send(src + offsets[q] * elem, counts[q] * elem, q, collective_slot(sub), kind));
  }
  for (auto& t : ts) wait(t);
  if (counts[me] == 0) return;
  // In rank order; `out` may alias this rank's shard of the input (read before written).
  std::vector<const void*> inputs(n);
  for (int q = 0; q < n; ++q) inputs[q] = q == me ? src + offsets[me] * elem : parts[q].data_ptr();
  reduce_into(out.data_ptr(), inputs.data(), n, counts[me], in.scalar_type(), op == ReduceOp::kAvg ? ReduceOp::kSum : op);
}

void GlooCommunicator::direct_all_gather(at::Tensor flat, const std::vector<int64_t>& counts, OpKind kind, int sub) {
  const int n = size(), me = rank_;
  const auto offsets = offsets_of(counts);
  const size_t elem = flat.element_size();
  char* base = static_cast<char*>(flat.data_ptr());
  std::vector<Transfer> ts;
  for (int q = 0; q < n; ++q) {
    if (q == me) continue;
    if (counts[q] > 0) ts.push_back(post_recv(base + offsets[q] * elem, counts[q] * elem, q, collective_slot(sub), kind));
    if (counts[me] > 0) ts.push_back(post_send(base + offsets[me] * elem, counts[me] * elem, q, collective_slot(sub), kind));
  }
  for (auto& t : ts) wait(t);
}

void GlooCommunicator::ring_all_gather(at::Tensor flat, const std::vector<int64_t>& counts) {
  const int n = size();
  const auto offsets = offsets_of(counts);
  const size_t elem = flat.element_size();
  const int right = (rank_ + 1) % n, left = (rank_ + n - 1) % n;
  auto chunk = [&](int c) { return flat.narrow(0, offsets[c], counts[c]); };
  for (int s = 0; s < n - 1; ++s) {
    const RingStep st = all_gather_step(rank_, n, s);
    Transfer recv, send;
    if (counts[st.recv_chunk] > 0)
      recv = post_recv(chunk(st.recv_chunk).data_ptr(), counts[st.recv_chunk] * elem, left, collective_slot(s), OpKind::kAllGather);
    if (counts[st.send_chunk] > 0)
      send = post_send(chunk(st.send_chunk).data_ptr(), counts[st.send_chunk] * elem, right, collective_slot(s), OpKind::kAllGather);
    wait(recv);
    wait(send);
  }
}

// ---- entry points

namespace {

// A view of an inline payload as a tensor shaped like `like` (valid until the next operation).
at::Tensor inline_view(const Round& round, int rank, const at::Tensor& like) {
  return at::from_blob(const_cast<uint8_t*>(round.payload[rank]), like.sizes(), like.options());
}

}  // namespace

WorkPtr GlooCommunicator::all_reduce_async(at::Tensor tensor, ReduceOp op) {
  check_tensor(tensor, "all_reduce", "tensor");
  check_reduce_op(op, tensor, "all_reduce");
  return enqueue(OpKind::kAllReduce, "all_reduce", [this, tensor, op](std::vector<at::Tensor>& result) mutable {
    at::Tensor work = tensor.is_contiguous() ? tensor : tensor.contiguous();
    const bool small = fits_inline(work.nbytes()) && size() > 1;
    if (small || options_.verify) {
      Header h = header_of(work, OpKind::kAllReduce, op, 0);
      h.inlined = small;
      Round round = header_round(h, [&](int) { return small ? &work : nullptr; });
      verify_same(round.headers, "all_reduce", true);
      if (small) {  // everyone has everything: combine in rank order, identically everywhere
        at::Tensor acc = (rank_ == 0 ? work : inline_view(round, 0, work)).clone();
        for (int p = 1; p < size(); ++p) reduce_inplace(acc, p == rank_ ? work : inline_view(round, p, work), op);
        work.copy_(acc);
      }
    }
    if (!small && use_ring(work.nbytes())) {
      ring_all_reduce(work.view(-1), op);
    } else if (!small && size() > 1) {
      at::Tensor flat = work.view(-1);
      const auto counts = shard_sizes(flat.numel(), size());
      at::Tensor mine = flat.narrow(0, offsets_of(counts)[rank_], counts[rank_]);
      direct_reduce_scatter(flat, mine, counts, op, OpKind::kAllReduce, 0);
      direct_all_gather(flat, counts, OpKind::kAllReduce, 1);
    }
    finish_avg(work, op, size());
    if (!tensor.is_contiguous()) tensor.copy_(work);
    result = {tensor};
  });
}

WorkPtr GlooCommunicator::broadcast_async(at::Tensor tensor, int root) {
  check_tensor(tensor, "broadcast", "tensor");
  check_root(root, "broadcast");
  return enqueue(OpKind::kBroadcast, "broadcast", [this, tensor, root](std::vector<at::Tensor>& result) mutable {
    at::Tensor work = tensor.is_contiguous() ? tensor : tensor.contiguous();
    const bool small = fits_inline(work.nbytes()) && size() > 1;
    if (small || options_.verify) {
      Header h = header_of(work, OpKind::kBroadcast, ReduceOp::kSum, root);
      h.inlined = small;
      Round round = header_round(h, [&](int) { return small && rank_ == root ? &work : nullptr; });
      verify_same(round.headers, "broadcast", true);
      if (small && rank_ != root && work.numel() > 0) work.copy_(inline_view(round, root, work));
    }
    if (!small && work.numel() > 0 && size() > 1) {
      std::vector<Transfer> ts;
      if (rank_ == root) {
        for (int p = 0; p < size(); ++p)
          if (p != root) ts.push_back(post_send(work.data_ptr(), work.nbytes(), p, collective_slot(0), OpKind::kBroadcast));
      } else {
        ts.push_back(post_recv(work.data_ptr(), work.nbytes(), root, collective_slot(0), OpKind::kBroadcast));
      }
      for (auto& t : ts) wait(t);
    }
    if (!tensor.is_contiguous()) tensor.copy_(work);
    result = {tensor};
  });
}

WorkPtr GlooCommunicator::reduce_async(at::Tensor tensor, int root, ReduceOp op) {
  check_tensor(tensor, "reduce", "tensor");
  check_root(root, "reduce");
  check_reduce_op(op, tensor, "reduce");
  return enqueue(OpKind::kReduce, "reduce", [this, tensor, root, op](std::vector<at::Tensor>& result) mutable {
    at::Tensor work = tensor.contiguous();
    const bool small = fits_inline(work.nbytes()) && size() > 1;
    std::vector<at::Tensor> parts(size());  // every rank's buffer, on root
    if (small || options_.verify) {
      Header h = header_of(work, OpKind::kReduce, op, root);
      h.inlined = small;
      Round round = header_round(h, [&](int p) { return small && p == root ? &work : nullptr; });
      verify_same(round.headers, "reduce", true);
      if (small && rank_ == root) {
        for (int p = 0; p < size(); ++p) if (p != root && work.numel() > 0) parts[p] = inline_view(round, p, work);
      }
    }
    if (rank_ != root) {
      if (!small && work.numel() > 0) {
        Transfer t = post_send(work.data_ptr(), work.nbytes(), root, collective_slot(0), OpKind::kReduce);
        wait(t);
      }
      result = {tensor};
      return;
    }
    if (!small) {
      std::vector<Transfer> ts;
      for (int p = 0; p < size(); ++p) {
        if (p == root || work.numel() == 0) continue;
        parts[p] = at::empty_like(work);
        ts.push_back(post_recv(parts[p].data_ptr(), work.nbytes(), p, collective_slot(0), OpKind::kReduce));
      }
      for (auto& t : ts) wait(t);
    }
    parts[root] = work;
    // Reduce in rank order, so the result does not depend on arrival order.
    at::Tensor acc = parts[0].defined() ? parts[0].clone() : work.clone();
    for (int p = 1; p < size(); ++p) if (parts[p].defined()) reduce_inplace(acc, parts[p], op);
    finish_avg(acc, op, size());
    tensor.copy_(acc);
    result = {tensor};
  });
}

WorkPtr GlooCommunicator::all_gather_async(const at::Tensor& input, at::Tensor output) {
  check_all_gather(input, output);
  return enqueue(OpKind::kAllGather, "all_gather", [this, input, output](std::vector<at::Tensor>& result) mutable {
    // Sizes may differ by rank, so the header round always runs here.
    at::Tensor mine_data = input.contiguous();
    const bool small = fits_inline(mine_data.nbytes());
    Header mine = header_of(input, OpKind::kAllGather, ReduceOp::kSum, 0);
    mine.aux = output.defined() ? output.numel() : -1;
    mine.inlined = small;
    Round round = header_round(mine, [&](int) { return small ? &mine_data : nullptr; });
    const std::vector<Header>& all = round.headers;
    std::vector<Header> kinds = all;
    bool all_inline = true;
    for (auto& h : kinds) {
      all_inline = all_inline && h.inlined;
      h.aux = 0;
      h.inlined = 0;
    }
    verify_same(kinds, "all_gather", false);
    std::vector<int64_t> counts(size());
    for (int r = 0; r < size(); ++r) counts[r] = all[r].numel;
    int64_t total = 0;
    for (auto c : counts) total += c;
    for (int r = 0; r < size(); ++r) {
      if (all[r].aux >= 0 && all[r].aux != total) {
        throw MismatchError(str_cat(where("all_gather"), ": rank ", r, " passed an output of ", all[r].aux,
                                    " elements but the inputs total ", total));
      }
    }
    at::Tensor flat = output.defined() && output.is_contiguous() ? output.view(-1)
                                                                 : at::empty({total}, input.options());
    const auto offsets = offsets_of(counts);
    flat.narrow(0, offsets[rank_], counts[rank_]).copy_(mine_data.view(-1));
    if (all_inline) {
      for (int r = 0; r < size(); ++r) {
        if (r == rank_ || counts[r] == 0) continue;
        flat.narrow(0, offsets[r], counts[r]).copy_(inline_view(round, r, flat.narrow(0, 0, counts[r])));
      }
    } else if (size() > 1) {
      if (use_ring(flat.nbytes())) {
        ring_all_gather(flat, counts);
      } else {
        direct_all_gather(flat, counts, OpKind::kAllGather, 0);
      }
    }
    if (output.defined() && !output.is_contiguous()) output.view(-1).copy_(flat);
    result = {output.defined() ? output : flat};
    for (int r = 0; r < size(); ++r) {
      std::vector<int64_t> shape(all[r].shape, all[r].shape + all[r].ndim);
      result.push_back(flat.narrow(0, offsets[r], counts[r]).view(shape));
    }
  });
}

WorkPtr GlooCommunicator::reduce_scatter_async(const at::Tensor& input, ReduceOp op, at::Tensor output,
                                               std::vector<int64_t> counts) {
  check_reduce_scatter(input, output, counts);
  check_reduce_op(op, input, "reduce_scatter");
  return enqueue(OpKind::kReduceScatter, "reduce_scatter", [this, input, op, output, counts](std::vector<at::Tensor>& result) mutable {
    at::Tensor flat = contiguous_flat(input);
    const auto offsets = offsets_of(counts);
    const int64_t max_count = *std::max_element(counts.begin(), counts.end());
    const bool small = fits_inline(max_count * flat.element_size()) && size() > 1;
    at::Tensor out = output.defined() && output.is_contiguous() ? output.view(-1)
                                                                : at::empty({counts[rank_]}, input.options());
    if (small || options_.verify) {
      Header h = header_of(input, OpKind::kReduceScatter, op, 0);
      h.ndim = 1;
      h.shape[0] = input.numel();
      for (int d = 1; d < 8; ++d) h.shape[d] = 0;
      h.aux = hash_sizes(counts);
      h.inlined = small;
      // Each peer receives only its own shard of this rank's input: the ring's volume in one round.
      std::vector<at::Tensor> shards(size());
      for (int p = 0; p < size(); ++p) shards[p] = flat.narrow(0, offsets[p], counts[p]);
      Round round = header_round(h, [&](int p) { return small && counts[p] > 0 ? &shards[p] : nullptr; });
      verify_same(round.headers, "reduce_scatter", true);
      if (small) {
        const at::Tensor& mine = shards[rank_];
        at::Tensor acc = (rank_ == 0 || mine.numel() == 0 ? mine : inline_view(round, 0, mine)).clone();
        for (int p = 1; p < size() && mine.numel() > 0; ++p) reduce_inplace(acc, p == rank_ ? mine : inline_view(round, p, mine), op);
        out.copy_(acc);
      }
    }
    if (!small && use_ring(flat.nbytes())) {
      ring_reduce_scatter(flat, out, counts, op);
    } else if (!small) {
      direct_reduce_scatter(flat, out, counts, op, OpKind::kReduceScatter, 0);
    }
    finish_avg(out, op, size());
    if (output.defined() && !output.is_contiguous()) output.view(-1).copy_(out);
    result = {output.defined() ? output : out};
  });
}

WorkPtr GlooCommunicator::gather_async(const at::Tensor& input, int root) {
  check_tensor(input, "gather", "input");
  check_root(root, "gather");
  return enqueue(OpKind::kGather, "gather", [this, input, root](std::vector<at::Tensor>& result) {
    at::Tensor data = input.contiguous();
    Header mine = header_of(input, OpKind::kGather, ReduceOp::kSum, root);
    mine.inlined = fits_inline(data.nbytes());
    Round round = header_round(mine, [&](int p) { return mine.inlined && p == root ? &data : nullptr; });
    std::vector<Header> kinds = round.headers;
    for (auto& h : kinds) h.inlined = 0;
    verify_same(kinds, "gather", false);
    if (rank_ != root) {
      if (!mine.inlined && data.numel() > 0) {
        Transfer t = post_send(data.data_ptr(), data.nbytes(), root, collective_slot(0), OpKind::kGather);
        wait(t);
      }
      result.clear();
      return;
    }
    result.assign(size(), at::Tensor());
    std::vector<Transfer> ts;
    for (int p = 0; p < size(); ++p) {
      const Header& h = round.headers[p];
      std::vector<int64_t> shape(h.shape, h.shape + h.ndim);
      if (p == root) {
        result[p] = data.clone();
        continue;
      }
      result[p] = at::empty(shape, input.options());
      if (result[p].numel() == 0) continue;
      if (h.inlined) {
        result[p].copy_(inline_view(round, p, result[p]));
      } else {
        ts.push_back(post_recv(result[p].data_ptr(), result[p].nbytes(), p, collective_slot(0), OpKind::kGather));
      }
    }
    for (auto& t : ts) wait(t);
  });
}

WorkPtr GlooCommunicator::scatter_async(at::Tensor output, std::vector<at::Tensor> inputs, int root) {
  check_scatter(output, inputs, root);
  return enqueue(OpKind::kScatter, "scatter", [this, output, inputs, root](std::vector<at::Tensor>& result) mutable {
    std::vector<at::Tensor> sources(inputs.size());
    for (size_t p = 0; p < inputs.size(); ++p) sources[p] = inputs[p].contiguous();
    Header mine = header_of(output, OpKind::kScatter, ReduceOp::kSum, root);
    if (rank_ == root) {
      std::vector<int64_t> sizes;
      for (const auto& t : inputs) sizes.push_back(t.numel());
      mine.aux = hash_sizes(sizes);
    }
    // The root inlines each rank's piece when it fits; a receiver learns which from the root's header.
    Round round = header_round(mine, [&](int p) {
      return rank_ == root && sources[p].numel() > 0 && fits_inline(sources[p].nbytes()) ? &sources[p] : nullptr;
    });
    std::vector<Header> kinds = round.headers;
    for (auto& h : kinds) h.aux = 0;
    verify_same(kinds, "scatter", false);
    std::vector<int64_t> out_sizes;
    for (const auto& h : round.headers) out_sizes.push_back(h.numel);
    if (hash_sizes(out_sizes) != round.headers[root].aux) {
      throw MismatchError(str_cat(where("scatter"), ": the root's inputs do not match the ranks' output sizes"));
    }
    at::Tensor out = output.is_contiguous() ? output : at::empty_like(output, at::MemoryFormat::Contiguous);
    std::vector<Transfer> ts;
    if (rank_ == root) {
      for (int p = 0; p < size(); ++p) {
        if (p == root) {
          out.view(-1).copy_(sources[p].view(-1));
        } else if (sources[p].numel() > 0 && !fits_inline(sources[p].nbytes())) {
          ts.push_back(post_send(sources[p].data_ptr(), sources[p].nbytes(), p, collective_slot(0), OpKind::kScatter));
        }
      }
    } else if (out.numel() > 0) {
      if (round.payload[root]) {
        out.copy_(inline_view(round, root, out));
      } else {
        ts.push_back(post_recv(out.data_ptr(), out.nbytes(), root, collective_slot(0), OpKind::kScatter));
      }
    }
    for (auto& t : ts) wait(t);
    if (!output.is_contiguous()) output.copy_(out);
    result = {output};
  });
}

WorkPtr GlooCommunicator::all_to_all_async(std::vector<at::Tensor> inputs) {
  check_all_to_all(inputs);
  return enqueue(OpKind::kAllToAll, "all_to_all", [this, inputs](std::vector<at::Tensor>& result) {
    // Each pair exchanges a header describing the tensor it sends, then the data.
    const int n = size();
    std::vector<Header> mine(n), theirs(n);
    std::vector<Transfer> ts;
    for (int p = 0; p < n; ++p) {
      if (p == rank_) continue;
      mine[p] = header_of(inputs[p], OpKind::kAllToAll, ReduceOp::kSum, 0);
      ts.push_back(post_recv(&theirs[p], sizeof(Header), p, collective_slot(kHeaderSub), OpKind::kVerify));
      ts.push_back(post_send(&mine[p], sizeof(Header), p, collective_slot(kHeaderSub), OpKind::kVerify));
    }
    for (auto& t : ts) wait(t);
    ts.clear();
    for (int p = 0; p < n; ++p) {
      if (p == rank_) continue;
      if (theirs[p].kind != static_cast<int32_t>(OpKind::kAllToAll) || theirs[p].dtype != static_cast<int32_t>(inputs[0].scalar_type())) {
        throw MismatchError(str_cat(where("all_to_all"), ": ", peer_name(p), " sends ",
                                    theirs[p].kind == static_cast<int32_t>(OpKind::kAllToAll) ? describe(theirs[p]) : op_name(static_cast<OpKind>(theirs[p].kind)),
                                    " but this rank's inputs are ", inputs[0].scalar_type()));
      }
    }
    result.assign(n, at::Tensor());
    std::vector<at::Tensor> keep;
    for (int p = 0; p < n; ++p) {
      if (p == rank_) {
        result[p] = inputs[p].clone();
        continue;
      }
      std::vector<int64_t> shape(theirs[p].shape, theirs[p].shape + theirs[p].ndim);
      result[p] = at::empty(shape, inputs[0].options());
      if (result[p].numel() > 0)
        ts.push_back(post_recv(result[p].data_ptr(), result[p].nbytes(), p, collective_slot(0), OpKind::kAllToAll));
      at::Tensor src = inputs[p].contiguous();
      keep.push_back(src);
      if (src.numel() > 0)
        ts.push_back(post_send(src.data_ptr(), src.nbytes(), p, collective_slot(0), OpKind::kAllToAll));
    }
    for (auto& t : ts) wait(t);
  });
}

WorkPtr GlooCommunicator::barrier_async() {
  return enqueue(OpKind::kBarrier, "barrier", [this](std::vector<at::Tensor>&) {
    verify_same(exchange_headers(header_of(at::Tensor(), OpKind::kBarrier, ReduceOp::kSum, 0)), "barrier", true);
  });
}

}  // namespace gloo_backend
}  // namespace comm
}  // namespace meshtrain
