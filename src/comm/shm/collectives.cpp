// ShmCommunicator collectives.
//
// Note [Shared-memory steps]
// A collective is a sequence of steps. At each step a rank writes into its own
// buffers, then increments its step counter; a rank that needs a peer's data
// waits until that peer's counter reaches the step. Every rank posts the same
// number of steps in an operation (a function of the arguments, which the
// first step verifies), so the counters advance in lockstep and steps_ tells
// each rank where the operation began.
//
// Buffers: each rank has four, [op parity][chunk parity]; operation s writes
// only those of parity s % 2. Every operation's first step waits for every
// peer's first step, which a peer posts only after completing the operation
// before; so when operation s starts, every peer has finished reading what
// operation s - 2 left in the buffers of this parity. Within an operation,
// consecutive chunks alternate between the two buffers of its parity; each
// algorithm says why a buffer is free when it writes it again.
//
// Algorithms (S bytes, n ranks, B the buffer size, R = B / n the region of one peer):
//   all_reduce    S <= small: everyone publishes everything, everyone reduces
//                 all of it in rank order (1 step). Else reduce-scatter +
//                 all-gather by chunks: a rank copies each peer's piece of the
//                 chunk into that peer's region, reduces its own piece from
//                 every peer's region (straight from their buffers), publishes
//                 it, and copies the others' reduced pieces (2 steps per chunk;
//                 the next chunk's copy overlaps the peers' reductions).
//   reduce_scatter  the first half of that (1 step per chunk).
//   all_gather, broadcast, reduce  chunks of B through the owner's buffer.
//   gather, scatter, all_to_all  rounds of one region per pair (exchange()).
// Traffic: a rank's bytes sent are the bytes of its data its peers read;
// bytes received, what it reads from theirs.

#include <ATen/ATen.h>

#include <algorithm>
#include <cstring>

#include "../reduce.h"
#include "communicator.h"
#include "meshtrain/comm.h"
#include "meshtrain/util.h"
#include "util/shard.h"

namespace meshtrain {
namespace comm {
namespace shm_backend {

namespace {

int64_t clamp_len(int64_t total, int64_t offset, int64_t cap) {
  return std::max<int64_t>(0, std::min(cap, total - offset));
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

char* bytes_of(const at::Tensor& t) { return static_cast<char*>(t.data_ptr()); }

}  // namespace

// ---- steps

void ShmCommunicator::post_step() {
  ctrl(rank_).step.store(++steps_, std::memory_order_release);
  wake_peers();
}

void ShmCommunicator::wait_step(uint64_t target, const char* op, int peer) {
  if (peer >= 0) {
    const RankCtrl& c = ctrl(peer);
    if (c.step.load(std::memory_order_acquire) >= target) return;
    wait_until([&] { return c.step.load(std::memory_order_acquire) >= target; }, op, [&] { return peer; },
               "its next step");
    return;
  }
  int lagging = 0;
  auto ready = [&] {
    for (int q = 0; q < size(); ++q) {
      if (q != rank_ && ctrl(q).step.load(std::memory_order_acquire) < target) {
        lagging = q;
        return false;
      }
    }
    return true;
  };
  if (ready()) return;
  wait_until(ready, op, [&] { return lagging; }, "its next step");
}

std::vector<Header> ShmCommunicator::open_op(const Header& mine, uint64_t extent, const char* op) {
  const int h = half();
  RankCtrl& me = ctrl(rank_);
  me.header[h] = mine;
  me.header_seq[h] = op_seq();
  me.extent[h] = extent;
  post_step();
  wait_step(steps_, op);
  std::vector<Header> all(size());
  for (int q = 0; q < size(); ++q) {
    if (q == rank_) {
      all[q] = mine;
      continue;
    }
    if (ctrl(q).header_seq[h] != op_seq()) {
      throw MismatchError(str_cat(where(op), ": rank ", q, " is at operation ", ctrl(q).header_seq[h],
                                  " of this communicator and this rank at ", op_seq(),
                                  " (every rank must call collectives in the same order)"));
    }
    all[q] = ctrl(q).header[h];
  }
  counter_.add_sent(OpKind::kVerify, static_cast<int64_t>(sizeof(Header)) * (size() - 1));
  counter_.add_received(OpKind::kVerify, static_cast<int64_t>(sizeof(Header)) * (size() - 1));
  return all;
}

void ShmCommunicator::verify(const std::vector<Header>& all, const char* op, bool same_shape) const {
  const std::string problem = header_mismatch(all, same_shape, global_ranks());
  if (!problem.empty()) throw MismatchError(str_cat(where(op), ": ", problem));
}

// ---- all_reduce

void ShmCommunicator::all_reduce_small(at::Tensor& data, ReduceOp op) {
  const int n = size(), sub = half() * 2;
  const int64_t bytes = static_cast<int64_t>(data.nbytes());
  std::memcpy(buffer(rank_, sub), data.data_ptr(), bytes);
  Header h = header_of(data, OpKind::kAllReduce, op);
  h.inlined = 1;
  verify(open_op(h, bytes, "all_reduce"), "all_reduce", true);
  std::vector<const void*> in(n);
  for (int q = 0; q < n; ++q) in[q] = q == rank_ ? data.data_ptr() : buffer(q, sub);
  reduce_into(data.data_ptr(), in.data(), n, data.numel(), data.scalar_type(), op);
  counter_.add_sent(OpKind::kAllReduce, bytes * (n - 1));
  counter_.add_received(OpKind::kAllReduce, bytes * (n - 1));
}

void ShmCommunicator::all_reduce_chunked(at::Tensor& data, ReduceOp op) {
  const int n = size(), me = rank_, h2 = half() * 2;
  const int64_t elem = data.element_size(), numel = data.numel();
  const auto counts = shard_sizes(numel, n);
  const auto offs = offsets_of(counts);
  const int64_t R = static_cast<int64_t>(layout_.region_bytes()), c = R / elem;
  const int64_t chunks = std::max<int64_t>(1, ceil_div(counts[0], c));
  char* base_ptr = bytes_of(data);
  auto piece = [&](int q, int64_t k) { return clamp_len(counts[q], k * c, c); };
  auto at = [&](int q, int64_t k) { return base_ptr + (offs[q] + k * c) * elem; };
  auto prepare = [&](int64_t k) {  // each peer's piece of chunk k into that peer's region
    char* buf = buffer(me, h2 + (k & 1));
    for (int q = 0; q < n; ++q) {
      if (q != me && piece(q, k) > 0) std::memcpy(buf + q * R, at(q, k), piece(q, k) * elem);
    }
  };
  prepare(0);
  verify(open_op(header_of(data, OpKind::kAllReduce, op), 0, "all_reduce"), "all_reduce", true);
  // Steps: a_k = base + 1 + 2k (pieces of chunk k published), b_k = a_k + 1 (reduced piece published).
  const uint64_t base = steps_ - 1;
  std::vector<const void*> in(n);
  for (int64_t k = 0; k < chunks; ++k) {
    const int sub = h2 + (k & 1);
    if (k > 0) wait_step(base + 1 + 2 * k, "all_reduce");
    for (int q = 0; q < n; ++q) in[q] = q == me ? at(me, k) : buffer(q, sub) + me * R;
    reduce_into(at(me, k), in.data(), n, piece(me, k), data.scalar_type(), op);
    std::memcpy(buffer(me, sub) + me * R, at(me, k), piece(me, k) * elem);
    post_step();
    // The next chunk goes to the other buffer, which held chunk k - 1: every
    // peer read its region there before posting a_k, and reads this rank's
    // region `me` (being gathered now) only in this buffer.
    if (k + 1 < chunks) {
      prepare(k + 1);
      post_step();
    }
    wait_step(base + 2 + 2 * k, "all_reduce");
    for (int q = 0; q < n; ++q) {
      if (q != me && piece(q, k) > 0) std::memcpy(at(q, k), buffer(q, sub) + q * R, piece(q, k) * elem);
    }
  }
  const int64_t others = (numel - counts[me]) * elem, mine = counts[me] * elem * (n - 1);
  counter_.add_sent(OpKind::kAllReduce, others + mine);
  counter_.add_received(OpKind::kAllReduce, others + mine);
}

WorkPtr ShmCommunicator::start_all_reduce(at::Tensor tensor, ReduceOp op) {
  return enqueue(OpKind::kAllReduce, "all_reduce", [this, tensor, op](std::vector<at::Tensor>& result) {
    at::Tensor data = tensor.is_contiguous() ? tensor : tensor.contiguous();
    if (static_cast<size_t>(data.nbytes()) <= small_bytes_) {
      all_reduce_small(data, op);
    } else {
      all_reduce_chunked(data, op);
    }
    if (!tensor.is_contiguous()) tensor.copy_(data);
    result = {tensor};
  });
}

// ---- reduce_scatter

void ShmCommunicator::reduce_scatter_small(const at::Tensor& in, at::Tensor& out, const std::vector<int64_t>& counts,
                                           ReduceOp op, const Header& h) {
  const int n = size(), sub = half() * 2;
  const int64_t elem = in.element_size();
  const auto offs = offsets_of(counts);
  std::memcpy(buffer(rank_, sub), in.data_ptr(), in.nbytes());
  verify(open_op(h, 0, "reduce_scatter"), "reduce_scatter", true);
  std::vector<const void*> src(n);
  for (int q = 0; q < n; ++q) src[q] = (q == rank_ ? bytes_of(in) : buffer(q, sub)) + offs[rank_] * elem;
  reduce_into(out.data_ptr(), src.data(), n, counts[rank_], in.scalar_type(), op);
  counter_.add_sent(OpKind::kReduceScatter, (in.numel() - counts[rank_]) * elem);
  counter_.add_received(OpKind::kReduceScatter, counts[rank_] * elem * (n - 1));
}

void ShmCommunicator::reduce_scatter_chunked(const at::Tensor& in, at::Tensor& out,
                                             const std::vector<int64_t>& counts, ReduceOp op, const Header& h) {
  const int n = size(), me = rank_, h2 = half() * 2;
  const int64_t elem = in.element_size();
  const auto offs = offsets_of(counts);
  const int64_t R = static_cast<int64_t>(layout_.region_bytes()), c = R / elem;
  const int64_t chunks = std::max<int64_t>(1, ceil_div(*std::max_element(counts.begin(), counts.end()), c));
  char* src_ptr = bytes_of(in);
  auto piece = [&](int q, int64_t k) { return clamp_len(counts[q], k * c, c); };
  auto prepare = [&](int64_t k) {
    char* buf = buffer(me, h2 + (k & 1));
    for (int q = 0; q < n; ++q) {
      if (q != me && piece(q, k) > 0) std::memcpy(buf + q * R, src_ptr + (offs[q] + k * c) * elem, piece(q, k) * elem);
    }
  };
  prepare(0);
  verify(open_op(h, 0, "reduce_scatter"), "reduce_scatter", true);
  const uint64_t base = steps_ - 1;  // a_k = base + 1 + k: pieces of chunk k published
  std::vector<const void*> src(n);
  for (int64_t k = 0; k < chunks; ++k) {
    const int sub = h2 + (k & 1);
    if (k > 0) wait_step(base + 1 + k, "reduce_scatter");
    for (int q = 0; q < n; ++q) {
      src[q] = q == me ? src_ptr + (offs[me] + k * c) * elem : buffer(q, sub) + me * R;
    }
    // `out` may alias this rank's own shard of the input: element i is read before it is written.
    reduce_into(bytes_of(out) + k * c * elem, src.data(), n, piece(me, k), in.scalar_type(), op);
    // The other buffer held chunk k - 1, which every peer read before posting a_k.
    if (k + 1 < chunks) {
      prepare(k + 1);
      post_step();
    }
  }
  counter_.add_sent(OpKind::kReduceScatter, (in.numel() - counts[me]) * elem);
  counter_.add_received(OpKind::kReduceScatter, counts[me] * elem * (n - 1));
}

WorkPtr ShmCommunicator::start_reduce_scatter(const at::Tensor& input, ReduceOp op, at::Tensor output,
                                              std::vector<int64_t> counts) {
  return enqueue(OpKind::kReduceScatter, "reduce_scatter",
                 [this, input, op, output, counts](std::vector<at::Tensor>& result) {
    at::Tensor flat = input.contiguous().view(-1);
    at::Tensor out = output.defined() && output.is_contiguous() ? output.view(-1)
                                                                : at::empty({counts[rank_]}, input.options());
    Header h = header_of(input, OpKind::kReduceScatter, op);
    h.ndim = 1;
    h.shape[0] = input.numel();
    for (int d = 1; d < 8; ++d) h.shape[d] = 0;
    h.aux = hash_sizes(counts);
    if (static_cast<size_t>(flat.nbytes()) <= small_bytes_) {
      reduce_scatter_small(flat, out, counts, op, h);
    } else {
      reduce_scatter_chunked(flat, out, counts, op, h);
    }
    if (output.defined() && !output.is_contiguous()) output.copy_(out.view(output.sizes()));
    result = {output.defined() ? output : out};
  });
}

// ---- all_gather

WorkPtr ShmCommunicator::start_all_gather(const at::Tensor& input, at::Tensor output) {
  return enqueue(OpKind::kAllGather, "all_gather", [this, input, output](std::vector<at::Tensor>& result) {
    const int n = size(), me = rank_, h2 = half() * 2;
    const at::Tensor mine = input.contiguous();
    const int64_t B = static_cast<int64_t>(layout_.buffer_bytes), my_bytes = mine.nbytes();
    auto prepare = [&](int64_t k) {
      std::memcpy(buffer(me, h2 + (k & 1)), bytes_of(mine) + k * B, clamp_len(my_bytes, k * B, B));
    };
    prepare(0);
    Header h = header_of(input, OpKind::kAllGather);
    h.aux = output.defined() ? output.numel() : -1;
    const std::vector<Header> all = open_op(h, 0, "all_gather");
    std::vector<Header> kinds = all;  // sizes may differ by rank; kinds and dtypes may not
    for (auto& k : kinds) k.aux = 0;
    verify(kinds, "all_gather", false);
    std::vector<int64_t> counts(n);
    int64_t total = 0, largest = 0;
    for (int q = 0; q < n; ++q) {
      counts[q] = all[q].numel;
      total += counts[q];
      largest = std::max(largest, counts[q]);
    }
    for (int q = 0; q < n; ++q) {
      if (all[q].aux >= 0 && all[q].aux != total) {
        throw MismatchError(str_cat(where("all_gather"), ": rank ", q, " passed an output of ", all[q].aux,
                                    " elements but the inputs total ", total));
      }
    }
    at::Tensor flat = output.defined() && output.is_contiguous() ? output.view(-1) : at::empty({total}, input.options());
    const auto offs = offsets_of(counts);
    const int64_t elem = input.element_size();
    char* my_slot = bytes_of(flat) + offs[me] * elem;  // the input may be this very slot (in place)
    if (my_bytes > 0 && my_slot != bytes_of(mine)) std::memmove(my_slot, mine.data_ptr(), my_bytes);
    const int64_t chunks = std::max<int64_t>(1, ceil_div(largest * elem, B));
    const uint64_t base = steps_ - 1;  // a_k = base + 1 + k: chunk k published
    for (int64_t k = 0; k < chunks; ++k) {
      if (k > 0) wait_step(base + 1 + k, "all_gather");
      for (int q = 0; q < n; ++q) {
        const int64_t len = clamp_len(counts[q] * elem, k * B, B);
        if (q != me && len > 0) std::memcpy(bytes_of(flat) + offs[q] * elem + k * B, buffer(q, h2 + (k & 1)), len);
      }
      // The other buffer held chunk k - 1, which every peer copied before posting a_k.
      if (k + 1 < chunks) {
        prepare(k + 1);
        post_step();
      }
    }
    counter_.add_sent(OpKind::kAllGather, my_bytes * (n - 1));
    counter_.add_received(OpKind::kAllGather, (total - counts[me]) * elem);
    if (output.defined() && !output.is_contiguous()) output.copy_(flat.view(output.sizes()));
    result = {output.defined() ? output : flat};
    for (int q = 0; q < n; ++q) result.push_back(view_at(flat, offs[q], shape_of(all[q])));
  });
}

// ---- broadcast and reduce

WorkPtr ShmCommunicator::start_broadcast(at::Tensor tensor, int root) {
  return enqueue(OpKind::kBroadcast, "broadcast", [this, tensor, root](std::vector<at::Tensor>& result) {
    const int n = size(), h2 = half() * 2;
    at::Tensor data = tensor.is_contiguous() ? tensor : tensor.contiguous();
    const int64_t B = static_cast<int64_t>(layout_.buffer_bytes), S = data.nbytes();
    const int64_t chunks = std::max<int64_t>(1, ceil_div(S, B));
    auto chunk = [&](int64_t k) { return clamp_len(S, k * B, B); };
    if (rank_ == root) std::memcpy(buffer(rank_, h2), data.data_ptr(), chunk(0));
    verify(open_op(header_of(data, OpKind::kBroadcast, ReduceOp::kSum, root), 0, "broadcast"), "broadcast", true);
    const uint64_t base = steps_ - 1;  // a_k = base + 1 + k
    if (rank_ == root) {
      // A non-root posts a_k once it has copied chunk k - 1; chunk k reuses the buffer of chunk k - 2.
      for (int64_t k = 1; k < chunks; ++k) {
        if (k >= 2) wait_step(base + k, "broadcast");
        std::memcpy(buffer(rank_, h2 + (k & 1)), bytes_of(data) + k * B, chunk(k));
        post_step();
      }
      counter_.add_sent(OpKind::kBroadcast, S * (n - 1));
    } else {
      for (int64_t k = 0; k < chunks; ++k) {
        if (k > 0) wait_step(base + 1 + k, "broadcast", root);
        std::memcpy(bytes_of(data) + k * B, buffer(root, h2 + (k & 1)), chunk(k));
        if (k + 1 < chunks) post_step();
      }
      counter_.add_received(OpKind::kBroadcast, S);
    }
    if (!tensor.is_contiguous()) tensor.copy_(data);
    result = {tensor};
  });
}

WorkPtr ShmCommunicator::start_reduce(at::Tensor tensor, int root, ReduceOp op) {
  return enqueue(OpKind::kReduce, "reduce", [this, tensor, root, op](std::vector<at::Tensor>& result) {
    const int n = size(), h2 = half() * 2;
    at::Tensor data = tensor.contiguous();
    const int64_t B = static_cast<int64_t>(layout_.buffer_bytes), S = data.nbytes(), elem = data.element_size();
    const int64_t chunks = std::max<int64_t>(1, ceil_div(S, B));
    auto chunk = [&](int64_t k) { return clamp_len(S, k * B, B); };
    if (rank_ != root) std::memcpy(buffer(rank_, h2), data.data_ptr(), chunk(0));
    verify(open_op(header_of(data, OpKind::kReduce, op, root), 0, "reduce"), "reduce", true);
    const uint64_t base = steps_ - 1;  // a_k = base + 1 + k
    if (rank_ != root) {
      // The root posts a_k once it has reduced chunk k - 1; chunk k reuses the buffer of chunk k - 2.
      for (int64_t k = 1; k < chunks; ++k) {
        if (k >= 2) wait_step(base + k, "reduce", root);
        std::memcpy(buffer(rank_, h2 + (k & 1)), bytes_of(data) + k * B, chunk(k));
        post_step();
      }
      counter_.add_sent(OpKind::kReduce, S);
    } else {
      std::vector<const void*> in(n);
      for (int64_t k = 0; k < chunks; ++k) {
        if (k > 0) wait_step(base + 1 + k, "reduce");
        for (int q = 0; q < n; ++q) in[q] = q == root ? bytes_of(data) + k * B : buffer(q, h2 + (k & 1));
        reduce_into(bytes_of(data) + k * B, in.data(), n, chunk(k) / elem, data.scalar_type(), op);
        if (k + 1 < chunks) post_step();
      }
      counter_.add_received(OpKind::kReduce, S * (n - 1));
      tensor.copy_(data);
    }
    result = {tensor};
  });
}

// ---- gather, scatter, all_to_all: rounds of one region per pair

void ShmCommunicator::exchange(const std::vector<Span>& out, const std::vector<Span>& in, int64_t rounds,
                               int first_sub, OpKind kind) {
  const int n = size(), me = rank_, h2 = half() * 2;
  const int64_t R = static_cast<int64_t>(layout_.region_bytes());
  const uint64_t base = steps_;
  int64_t sent = 0, received = 0;
  for (int64_t t = 0; t < rounds; ++t) {
    // This buffer last held round t - 2 (or the op's descriptors), which every
    // peer read before posting round t - 1's step, which this rank awaited.
    const int sub = h2 + ((first_sub + t) & 1);
    for (int q = 0; q < n; ++q) {
      const int64_t len = q == me ? 0 : clamp_len(out[q].bytes, t * R, R);
      if (len > 0) std::memcpy(buffer(me, sub) + q * R, out[q].ptr + t * R, len);
      sent += len;
    }
    post_step();
    wait_step(base + 1 + t, op_name(kind));
    for (int q = 0; q < n; ++q) {
      const int64_t len = q == me ? 0 : clamp_len(in[q].bytes, t * R, R);
      if (len > 0) std::memcpy(in[q].ptr + t * R, buffer(q, sub) + me * R, len);
      received += len;
    }
  }
  counter_.add_sent(kind, sent);
  counter_.add_received(kind, received);
}

WorkPtr ShmCommunicator::start_gather(const at::Tensor& input, int root) {
  return enqueue(OpKind::kGather, "gather", [this, input, root](std::vector<at::Tensor>& result) {
    const int n = size();
    at::Tensor data = input.contiguous();
    const std::vector<Header> all = open_op(header_of(input, OpKind::kGather, ReduceOp::kSum, root), 0, "gather");
    verify(all, "gather", false);
    const int64_t R = static_cast<int64_t>(layout_.region_bytes()), elem = input.element_size();
    int64_t rounds = 0;
    for (int q = 0; q < n; ++q) if (q != root) rounds = std::max(rounds, ceil_div(all[q].numel * elem, R));
    std::vector<Span> out(n, Span{nullptr, 0}), in(n, Span{nullptr, 0});
    result.clear();
    if (rank_ == root) {
      result.assign(n, at::Tensor());
      for (int q = 0; q < n; ++q) {
        result[q] = q == root ? data.clone() : at::empty(shape_of(all[q]), input.options());
        if (q != root) in[q] = Span{bytes_of(result[q]), static_cast<int64_t>(result[q].nbytes())};
      }
    } else {
      out[root] = Span{bytes_of(data), static_cast<int64_t>(data.nbytes())};
    }
    exchange(out, in, rounds, 0, OpKind::kGather);
  });
}

WorkPtr ShmCommunicator::start_scatter(at::Tensor output, std::vector<at::Tensor> inputs, int root) {
  return enqueue(OpKind::kScatter, "scatter", [this, output, inputs, root](std::vector<at::Tensor>& result) {
    const int n = size();
    std::vector<at::Tensor> sources(inputs.size());
    for (size_t p = 0; p < inputs.size(); ++p) sources[p] = inputs[p].contiguous();
    Header mine = header_of(output, OpKind::kScatter, ReduceOp::kSum, root);
    if (rank_ == root) {
      std::vector<int64_t> sizes;
      for (const auto& t : inputs) sizes.push_back(t.numel());
      mine.aux = hash_sizes(sizes);
    }
    const std::vector<Header> all = open_op(mine, 0, "scatter");
    std::vector<Header> kinds = all;
    for (auto& h : kinds) h.aux = 0;
    verify(kinds, "scatter", false);
    std::vector<int64_t> out_sizes;
    for (const auto& h : all) out_sizes.push_back(h.numel);
    if (hash_sizes(out_sizes) != all[root].aux) {
      throw MismatchError(str_cat(where("scatter"), ": the root's inputs do not match the ranks' output sizes"));
    }
    const int64_t R = static_cast<int64_t>(layout_.region_bytes()), elem = output.element_size();
    int64_t rounds = 0;
    for (int q = 0; q < n; ++q) if (q != root) rounds = std::max(rounds, ceil_div(all[q].numel * elem, R));
    at::Tensor out = output.is_contiguous() ? output : at::empty_like(output, at::MemoryFormat::Contiguous);
    std::vector<Span> send(n, Span{nullptr, 0}), recv(n, Span{nullptr, 0});
    if (rank_ == root) {
      for (int q = 0; q < n; ++q) send[q] = Span{bytes_of(sources[q]), static_cast<int64_t>(sources[q].nbytes())};
      out.view(-1).copy_(sources[root].view(-1));
    } else {
      recv[root] = Span{bytes_of(out), static_cast<int64_t>(out.nbytes())};
    }
    exchange(send, recv, rounds, 0, OpKind::kScatter);
    if (!output.is_contiguous()) output.copy_(out);
    result = {output};
  });
}

WorkPtr ShmCommunicator::start_all_to_all(std::vector<at::Tensor> inputs) {
  return enqueue(OpKind::kAllToAll, "all_to_all", [this, inputs](std::vector<at::Tensor>& result) {
    const int n = size(), me = rank_, h2 = half() * 2;
    const int64_t R = static_cast<int64_t>(layout_.region_bytes());
    // What this rank sends each peer, described in that peer's region of buffer 0.
    std::vector<at::Tensor> sources(n);
    int64_t extent = 0;
    for (int q = 0; q < n; ++q) {
      sources[q] = inputs[q].contiguous();
      if (q == me) continue;
      const Header d = header_of(sources[q], OpKind::kAllToAll);
      std::memcpy(buffer(me, h2) + q * R, &d, sizeof d);
      extent = std::max<int64_t>(extent, sources[q].nbytes());
    }
    const std::vector<Header> all = open_op(header_of(inputs[0], OpKind::kAllToAll), extent, "all_to_all");
    verify(all, "all_to_all", false);
    int64_t rounds = 0;
    result.assign(n, at::Tensor());
    std::vector<Span> out(n, Span{nullptr, 0}), in(n, Span{nullptr, 0});
    for (int q = 0; q < n; ++q) {
      rounds = std::max<int64_t>(rounds, ceil_div(static_cast<int64_t>(ctrl(q).extent[half()]), R));
      if (q == me) {
        result[q] = inputs[q].clone();
        continue;
      }
      Header d;
      std::memcpy(&d, buffer(q, h2) + me * R, sizeof d);
      result[q] = at::empty(shape_of(d), inputs[0].options());
      in[q] = Span{bytes_of(result[q]), static_cast<int64_t>(result[q].nbytes())};
      out[q] = Span{bytes_of(sources[q]), static_cast<int64_t>(sources[q].nbytes())};
    }
    exchange(out, in, rounds, 1, OpKind::kAllToAll);
  });
}

WorkPtr ShmCommunicator::start_barrier() {
  return enqueue(OpKind::kBarrier, "barrier", [this](std::vector<at::Tensor>&) {
    verify(open_op(header_of(at::Tensor(), OpKind::kBarrier), 0, "barrier"), "barrier", true);
  });
}

}  // namespace shm_backend
}  // namespace comm
}  // namespace meshtrain
