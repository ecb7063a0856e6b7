// TcpCommunicator collectives: the skeleton every collective runs (the header
// round that verifies arguments across ranks and carries small payloads) and
// the entry points. Each collective's algorithm is in algorithms.cpp.
//
// Note [Collective skeleton]
// Every collective runs the same sequence on each rank; only its algorithm
// differs:
//   1. check the arguments (ConfigError on the caller's thread, before any
//      communication), and enqueue; when the operation runs:
//   2. make this rank's data contiguous (the work tensor);
//   3. open: the header round (Note [Header round]), with the payload inline
//      when it fits, then compare every rank's header (a MismatchError on
//      every rank);
//   4. run the algorithm: combine the inline payloads, or send the data by
//      ring or direct messages (Note [Gloo algorithms]);
//   5. copy the result into the caller's tensor when that is not contiguous.
// open() is step 3 for every collective. in_place() is steps 1-5 for
// all_reduce, broadcast and reduce, whose result replaces their input; the
// collectives with separate outputs spell out steps 2 and 5 around an
// open_...() of their own, because their headers carry sizes that may differ
// by rank. all_to_all alone opens differently: its inputs differ by peer, so
// each pair exchanges the header of what it sends instead.

#include <ATen/ATen.h>

#include <algorithm>
#include <cstring>

#include "communicator.h"
#include "meshtrain/comm.h"
#include "meshtrain/util.h"
#include "util/shard.h"

namespace meshtrain {
namespace comm {
namespace gloo_backend {

namespace {

at::Tensor contiguous_flat(const at::Tensor& t) { return t.contiguous().view(-1); }

// Where an algorithm writes a result of `numel` elements: the caller's output
// when it is contiguous, else a temporary that copy_back() copies into it.
at::Tensor flat_output(const at::Tensor& output, int64_t numel, const at::TensorOptions& options) {
  return output.defined() && output.is_contiguous() ? output.view(-1) : at::empty({numel}, options);
}

void copy_back(const at::Tensor& output, const at::Tensor& flat) {
  if (output.defined() && !output.is_contiguous()) output.copy_(flat.view(output.sizes()));
}

// Drops a deferred header round that an error left unsettled (its requests
// are withdrawn), so that it never reaches the next collective.
struct DeferredRound {
  explicit DeferredRound(std::unique_ptr<PendingRound>& pending) : pending(pending) {}
  ~DeferredRound() { pending.reset(); }
  std::unique_ptr<PendingRound>& pending;
};

int64_t sum_of(const std::vector<int64_t>& v) {
  int64_t total = 0;
  for (auto x : v) total += x;
  return total;
}

}  // namespace

// ---- the header round

// Note [Header round]
// Every collective that verifies its arguments, or whose payload is small,
// starts with one round in which each rank sends every peer a fixed-size
// Header, followed in the same message by an inline payload when it fits
// (CommOptions::inline_bytes). Receivers always post buffers of header +
// inline_bytes, so a peer with different arguments can never overflow them
// (a larger message fails only its receive: WaitResult::kTooLarge); the headers are
// then compared on every rank, and all raise the same MismatchError. For small
// payloads this round *is* the collective (one round instead of a ring's
// 2(n-1) steps); the data is then combined locally in rank order, which gives
// bit-identical results on every rank.

Round TcpCommunicator::header_round(const Header& mine,
                                     const std::function<InlineBytes(int)>& inline_for) {
  PendingRound pending = post_header_round(mine, inline_for);
  return finish_header_round(pending);
}

PendingRound TcpCommunicator::post_header_round(const Header& mine,
                                                 const std::function<InlineBytes(int)>& inline_for, bool hold) {
  const int n = size();
  prepare_round_buffers();
  PendingRound pending;
  pending.mine = mine;
  pending.inline_sent.assign(n, 0);
  for (int p = 0; p < n; ++p) {
    if (p == rank_) continue;
    pending.transfers.push_back(post_recv(round_recv_[p].data_ptr(), round_capacity(), p,
                                          collective_slot(kHeaderSub), OpKind::kVerify));
    pending.inline_sent[p] = write_round_message(p, mine, inline_for ? inline_for(p) : InlineBytes());
    pending.transfers.push_back(post_send(round_send_[p].data_ptr(), sizeof(Header) + pending.inline_sent[p], p,
                                          collective_slot(kHeaderSub), OpKind::kVerify, hold));
  }
  return pending;
}

Round TcpCommunicator::finish_header_round(PendingRound& pending) {
  const int n = size();
  wait_all(pending.transfers);
  Round round;
  round.headers.assign(n, Header());
  round.headers[rank_] = pending.mine;
  round.payload.assign(n, nullptr);
  for (int p = 0; p < n; ++p) {
    if (p != rank_) read_round_message(round, p, pending.inline_sent[p], static_cast<OpKind>(pending.mine.kind));
  }
  return round;
}

// Note [Verification beside the data]
// On the TCP links a collective whose algorithm needs nothing from the header
// round (no inline payload, no sizes learnt from it: all_reduce, broadcast,
// reduce and reduce_scatter of large buffers) posts the round and then its
// first messages at once, and the round is waited for and verified at the
// algorithm's first wait, before any data is. Headers and data of one pair
// travel in order on one connection, so a rank reads its peers' headers before
// their data, and verification costs no round trip of its own (broadcast of
// 64 KiB on 2 ranks: 34-57 us with the round first, 13-14 without any). The
// headers are held (tcp::Links::send) until the algorithm's first message to
// the same peer, and leave in its sendmsg: one pass through the kernel's TCP
// per peer instead of two, which is what a small exchange costs where ranks
// share cores. Safe
// because the links take a mismatch: a message larger than the receive it
// matched is read and dropped, failing only that receive (WaitResult::kTooLarge),
// and receives and sends not yet complete when the MismatchError is raised are
// withdrawn (Posted). What a mismatch may leave behind: this rank's output
// holds bytes a peer sent for another collective (a communicator that raised
// MismatchError refuses further work).
void TcpCommunicator::settle_round() {
  if (!pending_) return;
  std::unique_ptr<PendingRound> pending = std::move(pending_);  // wait_all below must not settle it again
  Round round = finish_header_round(*pending);
  if (pending->ignore) {
    for (Header& h : round.headers) pending->ignore(h);
  }
  verify_same(round.headers, pending->op, pending->same_shape);
}

void TcpCommunicator::prepare_round_buffers() {
  if (static_cast<int>(round_recv_.size()) == size()) return;
  round_recv_.assign(size(), at::Tensor());
  round_send_.assign(size(), at::Tensor());
  for (int p = 0; p < size(); ++p) {
    if (p == rank_) continue;
    round_recv_[p] = at::empty({round_capacity()}, at::kByte);
    round_send_[p] = at::empty({round_capacity()}, at::kByte);
  }
}

int64_t TcpCommunicator::write_round_message(int peer, const Header& mine, InlineBytes payload) {
  Header h = mine;
  h.inline_bytes = payload.data ? payload.bytes : 0;
  uint8_t* out = round_send_[peer].data_ptr<uint8_t>();
  std::memcpy(out, &h, sizeof(Header));
  if (h.inline_bytes > 0) std::memcpy(out + sizeof(Header), payload.data, h.inline_bytes);
  return h.inline_bytes;
}

void TcpCommunicator::read_round_message(Round& round, int peer, int64_t inline_sent, OpKind kind) {
  const uint8_t* in = round_recv_[peer].data_ptr<uint8_t>();
  std::memcpy(&round.headers[peer], in, sizeof(Header));
  const Header& h = round.headers[peer];
  if (h.magic != Header().magic || h.inline_bytes < 0 || h.inline_bytes > options_.inline_bytes) {
    throw CommError(str_cat(where("verify"), ": malformed header from ", peer_name(peer)));
  }
  if (h.inline_bytes > 0) round.payload[peer] = in + sizeof(Header);
  // wait() counted the posted capacity; count what arrived, and the inline
  // payload as the operation's data rather than verification.
  count(OpKind::kVerify, peer, -inline_sent, static_cast<int64_t>(sizeof(Header)) - round_capacity());
  count(kind, peer, inline_sent, h.inline_bytes);
}

void TcpCommunicator::verify_same(const std::vector<Header>& all, const char* op, bool same_shape) const {
  const std::string problem = header_mismatch(all, same_shape, global_ranks());
  if (!problem.empty()) throw MismatchError(str_cat(where(op), ": ", problem));
}

// ---- the skeleton

Round TcpCommunicator::open(const char* op, const Opening& opening) {
  if (!opening.needed && !options_.verify) return Round();
  if (opening.deferrable) {  // Note [Verification beside the data]
    pending_ = std::make_unique<PendingRound>(post_header_round(opening.header, opening.inline_for, /*hold=*/true));
    pending_->op = op;
    pending_->same_shape = opening.same_shape;
    pending_->ignore = opening.ignore;
    return Round();
  }
  Round round = doubling_ ? doubling_round(op, opening) : header_round(opening.header, opening.inline_for);
  std::vector<Header> compared = round.headers;
  if (opening.ignore) {
    for (Header& h : compared) opening.ignore(h);
  }
  verify_same(compared, op, opening.same_shape);
  return round;
}

WorkPtr TcpCommunicator::in_place(at::Tensor tensor, const InPlace& spec,
                                   std::function<void(Collective&)> algorithm) {
  return enqueue(spec.kind, spec.name, [this, tensor, spec, algorithm](std::vector<at::Tensor>& result) {
    Collective c;
    c.work = tensor.contiguous();
    c.small = fits_inline(c.work.nbytes()) && size() > 1;
    Opening opening(header_of(c.work, spec.kind, spec.op, spec.root));
    opening.header.inlined = c.small;
    opening.inline_for = [&](int p) { return inline_payload(spec, c, p); };
    opening.needed = c.small;
    opening.deferrable = !c.small;
    opening.fold = c.small && spec.kind == OpKind::kAllReduce && may_fold(c.work.scalar_type());
    DeferredRound deferred(pending_);
    c.round = open(spec.name, opening);
    algorithm(c);
    settle_round();  // an algorithm with nothing to wait for (one rank, no elements) still verifies
    const bool has_result = spec.flow != Flow::kToRoot || rank_ == spec.root;
    if (has_result && !tensor.is_contiguous()) tensor.copy_(c.work);
    result = {tensor};
  });
}

InlineBytes TcpCommunicator::inline_payload(const InPlace& spec, const Collective& c, int peer) const {
  if (!c.small) return InlineBytes();
  switch (spec.flow) {
    case Flow::kEveryRank:
      return inline_bytes_of(c.work);
    case Flow::kFromRoot:
      return rank_ == spec.root ? inline_bytes_of(c.work) : InlineBytes();
    case Flow::kToRoot:
      return peer == spec.root ? inline_bytes_of(c.work) : InlineBytes();
  }
  return InlineBytes();
}

// reduce_scatter's header describes the input as flat, with a hash of the
// shard sizes: ranks must agree on both, whatever shape each passed.
Collective TcpCommunicator::open_reduce_scatter(const at::Tensor& input, ReduceOp op,
                                                 const std::vector<int64_t>& counts) {
  Collective c;
  c.work = contiguous_flat(input);
  const int64_t max_count = *std::max_element(counts.begin(), counts.end());
  c.small = fits_inline(max_count * c.work.element_size()) && size() > 1;
  Opening opening(header_of(input, OpKind::kReduceScatter, op, 0));
  Header& h = opening.header;
  h.ndim = 1;
  h.shape[0] = input.numel();
  for (int d = 1; d < 8; ++d) h.shape[d] = 0;
  h.aux = hash_sizes(counts);
  h.inlined = c.small;
  // Each peer receives only its own shard of this rank's input: the ring's volume in one round.
  const auto offsets = offsets_of(counts);
  const uint8_t* base = static_cast<const uint8_t*>(c.work.data_ptr());
  const int64_t element = c.work.element_size();
  opening.inline_for = [&](int p) {
    return c.small && counts[p] > 0 ? InlineBytes{base + offsets[p] * element, counts[p] * element} : InlineBytes();
  };
  opening.needed = c.small;
  opening.deferrable = !c.small;
  opening.fold = c.small && may_fold(c.work.scalar_type());
  c.round = open("reduce_scatter", opening);
  return c;
}

// all_gather's round always runs: input sizes may differ by rank, and each
// rank learns the others' from it.
Collective TcpCommunicator::open_all_gather(const at::Tensor& input, const at::Tensor& output) {
  Collective c;
  c.work = input.contiguous();
  c.small = fits_inline(c.work.nbytes());
  Opening opening(header_of(input, OpKind::kAllGather, ReduceOp::kSum, 0));
  opening.header.aux = output.defined() ? output.numel() : -1;
  opening.header.inlined = c.small;
  opening.inline_for = [&](int) { return c.small ? inline_bytes_of(c.work) : InlineBytes(); };
  opening.needed = true;
  opening.same_shape = false;
  opening.ignore = [](Header& h) {
    h.aux = 0;
    h.inlined = 0;
  };
  c.round = open("all_gather", opening);
  return c;
}

// Each rank's element count, checked against the output size every rank passed.
std::vector<int64_t> TcpCommunicator::all_gather_counts(const std::vector<Header>& all) const {
  std::vector<int64_t> counts(size());
  for (int r = 0; r < size(); ++r) counts[r] = all[r].numel;
  const int64_t total = sum_of(counts);
  for (int r = 0; r < size(); ++r) {
    if (all[r].aux >= 0 && all[r].aux != total) {
      throw MismatchError(str_cat(where("all_gather"), ": rank ", r, " passed an output of ", all[r].aux,
                                  " elements but the inputs total ", total));
    }
  }
  return counts;
}

// gather's round always runs: the root learns each rank's size from it.
Collective TcpCommunicator::open_gather(const at::Tensor& input, int root) {
  Collective c;
  c.work = input.contiguous();
  c.small = fits_inline(c.work.nbytes());
  Opening opening(header_of(input, OpKind::kGather, ReduceOp::kSum, root));
  opening.header.inlined = c.small;
  opening.inline_for = [&](int p) { return c.small && p == root ? inline_bytes_of(c.work) : InlineBytes(); };
  opening.needed = true;
  opening.same_shape = false;
  opening.ignore = [](Header& h) { h.inlined = 0; };
  c.round = open("gather", opening);
  return c;
}

// scatter's round always runs: the root's header carries a hash of its inputs'
// sizes, which every rank checks against the outputs' sizes. The root inlines
// each rank's piece when it fits; a receiver learns which from the root's header.
Round TcpCommunicator::open_scatter(const at::Tensor& output, const std::vector<at::Tensor>& sources, int root) {
  Opening opening(header_of(output, OpKind::kScatter, ReduceOp::kSum, root));
  if (rank_ == root) {
    std::vector<int64_t> sizes;
    for (const auto& t : sources) sizes.push_back(t.numel());
    opening.header.aux = hash_sizes(sizes);
  }
  opening.inline_for = [&](int p) {
    return rank_ == root && scatter_inlines(sources[p]) ? inline_bytes_of(sources[p]) : InlineBytes();
  };
  opening.needed = true;
  opening.same_shape = false;
  opening.ignore = [](Header& h) { h.aux = 0; };
  Round round = open("scatter", opening);
  std::vector<int64_t> out_sizes;
  for (const auto& h : round.headers) out_sizes.push_back(h.numel);
  if (hash_sizes(out_sizes) != round.headers[root].aux) {
    throw MismatchError(str_cat(where("scatter"), ": the root's inputs do not match the ranks' output sizes"));
  }
  return round;
}

// all_to_all's opening: each pair exchanges a header describing the tensor it sends.
std::vector<Header> TcpCommunicator::exchange_pair_headers(const std::vector<at::Tensor>& inputs) {
  std::vector<Header> mine(size()), theirs(size());
  std::vector<Transfer> ts;
  for (int p = 0; p < size(); ++p) {
    if (p == rank_) continue;
    mine[p] = header_of(inputs[p], OpKind::kAllToAll, ReduceOp::kSum, 0);
    ts.push_back(post_recv(&theirs[p], sizeof(Header), p, collective_slot(kHeaderSub), OpKind::kVerify));
    ts.push_back(post_send(&mine[p], sizeof(Header), p, collective_slot(kHeaderSub), OpKind::kVerify));
  }
  wait_all(ts);
  return theirs;
}

void TcpCommunicator::check_pair_headers(const std::vector<Header>& theirs, at::ScalarType dtype) const {
  for (int p = 0; p < size(); ++p) {
    if (p == rank_) continue;
    const Header& h = theirs[p];
    const bool same_kind = h.kind == static_cast<int32_t>(OpKind::kAllToAll);
    if (!same_kind || h.dtype != static_cast<int32_t>(dtype)) {
      throw MismatchError(str_cat(where("all_to_all"), ": ", peer_name(p), " sends ",
                                  same_kind ? describe(h) : op_name(static_cast<OpKind>(h.kind)),
                                  " but this rank's inputs are ", dtype));
    }
  }
}

// ---- entry points

WorkPtr TcpCommunicator::start_all_reduce(at::Tensor tensor, ReduceOp op) {
  return in_place(tensor, {OpKind::kAllReduce, "all_reduce", op, 0, Flow::kEveryRank},
                  [this, op](Collective& c) { all_reduce_algorithm(c, op); });
}

WorkPtr TcpCommunicator::start_broadcast(at::Tensor tensor, int root) {
  return in_place(tensor, {OpKind::kBroadcast, "broadcast", ReduceOp::kSum, root, Flow::kFromRoot},
                  [this, root](Collective& c) { broadcast_algorithm(c, root); });
}

WorkPtr TcpCommunicator::start_reduce(at::Tensor tensor, int root, ReduceOp op) {
  return in_place(tensor, {OpKind::kReduce, "reduce", op, root, Flow::kToRoot},
                  [this, root, op](Collective& c) { reduce_algorithm(c, root, op); });
}

WorkPtr TcpCommunicator::start_reduce_scatter(const at::Tensor& input, ReduceOp op, at::Tensor output,
                                               std::vector<int64_t> counts) {
  auto body = [this, input, op, output, counts](std::vector<at::Tensor>& result) {
    DeferredRound deferred(pending_);
    const Collective c = open_reduce_scatter(input, op, counts);
    at::Tensor out = flat_output(output, counts[rank_], input.options());
    reduce_scatter_algorithm(c, out, counts, op);
    settle_round();
    copy_back(output, out);
    result = {output.defined() ? output : out};
  };
  return enqueue(OpKind::kReduceScatter, "reduce_scatter", body);
}

WorkPtr TcpCommunicator::start_all_gather(const at::Tensor& input, at::Tensor output) {
  return enqueue(OpKind::kAllGather, "all_gather", [this, input, output](std::vector<at::Tensor>& result) {
    const Collective c = open_all_gather(input, output);
    const std::vector<int64_t> counts = all_gather_counts(c.round.headers);
    at::Tensor flat = flat_output(output, sum_of(counts), input.options());
    all_gather_algorithm(c, flat, counts);
    copy_back(output, flat);
    // The whole output, then each rank's input in its own shape (views of it).
    result = {output.defined() ? output : flat};
    const auto offsets = offsets_of(counts);
    for (int r = 0; r < size(); ++r) {
      result.push_back(view_at(flat, offsets[r], shape_of(c.round.headers[r])));
    }
  });
}

WorkPtr TcpCommunicator::start_gather(const at::Tensor& input, int root) {
  return enqueue(OpKind::kGather, "gather", [this, input, root](std::vector<at::Tensor>& result) {
    const Collective c = open_gather(input, root);
    if (rank_ == root) {
      result = gather_on_root(c, root);
      return;
    }
    if (!c.small && c.work.numel() > 0) send_and_wait(c.work, root, OpKind::kGather);
    result.clear();
  });
}

WorkPtr TcpCommunicator::start_scatter(at::Tensor output, std::vector<at::Tensor> inputs, int root) {
  return enqueue(OpKind::kScatter, "scatter", [this, output, inputs, root](std::vector<at::Tensor>& result) {
    std::vector<at::Tensor> sources(inputs.size());
    for (size_t p = 0; p < inputs.size(); ++p) sources[p] = inputs[p].contiguous();
    const Round round = open_scatter(output, sources, root);
    at::Tensor out = output.is_contiguous() ? output : at::empty_like(output, at::MemoryFormat::Contiguous);
    scatter_algorithm(round, sources, out, root);
    if (!output.is_contiguous()) output.copy_(out);
    result = {output};
  });
}

WorkPtr TcpCommunicator::start_all_to_all(std::vector<at::Tensor> inputs) {
  return enqueue(OpKind::kAllToAll, "all_to_all", [this, inputs](std::vector<at::Tensor>& result) {
    const std::vector<Header> theirs = exchange_pair_headers(inputs);
    check_pair_headers(theirs, inputs[0].scalar_type());
    result = all_to_all_direct(inputs, theirs);
  });
}

WorkPtr TcpCommunicator::start_barrier() {
  return enqueue(OpKind::kBarrier, "barrier", [this](std::vector<at::Tensor>&) {
    // The round is the barrier: no rank completes it before every rank has sent its header.
    Opening opening(header_of(at::Tensor(), OpKind::kBarrier, ReduceOp::kSum, 0));
    opening.needed = true;
    open("barrier", opening);
  });
}

}  // namespace gloo_backend
}  // namespace comm
}  // namespace meshtrain
