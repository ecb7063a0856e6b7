// MpiCommunicator collectives: the verification round, then one non-blocking
// MPI collective per operation. Traffic follows Note [MPI traffic] in
// communicator.h. Every buffer a request reads or writes is passed to wait(),
// which keeps it alive for good if the request can never finish (timeout);
// that includes the count and displacement arrays of the "v" collectives,
// which MPI may read until completion.

#include <ATen/ATen.h>

#include <algorithm>
#include <climits>
#include <cstring>

#include "../reduce.h"
#include "communicator.h"
#include "meshtrain/comm.h"
#include "meshtrain/util.h"
#include "util/shard.h"
#include "runtime.h"

namespace meshtrain {
namespace comm {
namespace mpi_backend {

namespace {

static_assert(sizeof(Header) == 120, "the verification round's cost is documented as 120 bytes per rank");

// all_gather's aux is the output's size, or -1 without one; split marks its exchange with this.
constexpr int64_t kSplitting = -2;

char* bytes_of(const at::Tensor& t) { return static_cast<char*>(t.data_ptr()); }

at::Tensor contiguous(const at::Tensor& t) { return t.is_contiguous() ? t : t.contiguous(); }

// MPI's counts and displacements are ints: an array of them that lives as long as the request.
at::Tensor int_array(const std::vector<int64_t>& v) {
  at::Tensor t = at::empty({static_cast<int64_t>(v.size())}, at::kInt);
  for (size_t i = 0; i < v.size(); ++i) t.data_ptr<int>()[i] = static_cast<int>(v[i]);
  return t;
}

int* ints(const at::Tensor& t) { return t.data_ptr<int>(); }

bool overlap(const at::Tensor& a, const at::Tensor& b) {
  const char *pa = bytes_of(a), *pb = bytes_of(b);
  return a.nbytes() > 0 && b.nbytes() > 0 && pa < pb + b.nbytes() && pb < pa + a.nbytes();
}

bool all_equal(const std::vector<int64_t>& v) {
  return std::all_of(v.begin(), v.end(), [&](int64_t x) { return x == v[0]; });
}

}  // namespace

// ---- verification

// Note [MPI header round]
// Groups of up to kDirectRoundMax ranks exchange headers point to point: each
// rank sends its header to every peer (MPI_Isend on a duplicate of the
// communicator, apart from user tags) and receives theirs into buffers of a
// header plus CommOptions::inline_bytes, so a peer's message always fits
// whatever it passed. The message may carry the rank's data: an all_reduce of
// up to inline_bytes is then that one round, each rank reducing every rank's
// data in rank order (identical bits everywhere), where it was an
// MPI_Iallgather of the headers and an MPI_Iallreduce after it, two
// collectives of OpenMPI's non-blocking library (libnbc) at ~7 us each here
// for a 4 KiB all-reduce on 2 ranks; broadcast, all_gather and reduce_scatter
// (each peer its shard) ride the same way. Larger groups keep MPI_Iallgather:
// n - 1 messages per rank per collective stop paying beyond a few ranks.
// Every verified collective of a group opens with the same round (and those
// whose data rides in it, verified or not), so ranks that call different
// collectives still meet and raise MismatchError.
//
// A message goes in two MPI messages where one would exceed what OpenMPI
// sends eagerly (first_message_bytes_: its shared-memory eager limit, read
// through the MPI tool interface, less its own headers) and the rest fits it:
// the header and the payload's first part on tag 0, the rest on tag 1, both
// eager, where one message of header + 4 KiB went by rendezvous (a handshake,
// ~7 us more here). The header says how much follows (inline_after), so the
// receiver posts for exactly that, whatever it expected: ranks that called
// different collectives still drain each other. Point-to-point messages with
// an inline payload split the same way (Note [MPI messages] in p2p.cpp).
std::vector<Header> MpiCommunicator::exchange_headers(const Header& mine, const char* op) {
  return header_round(mine, op, nullptr).headers;
}

MpiCommunicator::Round MpiCommunicator::header_round(const Header& mine, const char* op,
                                                     const PayloadFor& payload_for) {
  const int n = size();
  Round round;
  round.payload.assign(n, nullptr);
  if (n == 1 || !direct_round()) {
    round.headers = allgather_headers(mine, op);
    return round;
  }
  for (int p = 0; p < n; ++p) {  // before anything is posted: a refusal leaves nothing behind
    const at::Tensor* payload = p != rank_ && payload_for ? payload_for(p) : nullptr;
    MESHTRAIN_CHECK(!payload || static_cast<int64_t>(payload->nbytes()) <= options_.inline_bytes, where(op),
                    ": an inline payload of ", payload->nbytes(), " bytes exceeds ", options_.inline_bytes);
  }
  std::vector<MPI_Request> first, second;  // the first messages; the seconds (sends only, until the headers came)
  post_round_messages(mine, op, payload_for, first, second);
  wait(first, op, {round_send_, round_recv_}, "every rank's header");
  round.headers.assign(n, mine);
  read_round_headers(round, op, second);
  if (!second.empty()) wait(second, op, {round_send_, round_recv_}, "the rest of every rank's inline data");
  add_traffic(OpKind::kVerify, sizeof(Header), (n - 1) * static_cast<int64_t>(sizeof(Header)));
  return round;
}

// Posts the receives of every peer's first message (a whole header and
// inline payload fit) and this rank's messages: to each peer its header and
// as much of its payload as goes in first_message_bytes_, the rest in a second
// message (tag 1), whose send joins `second`.
void MpiCommunicator::post_round_messages(const Header& mine, const char* op, const PayloadFor& payload_for,
                                          std::vector<MPI_Request>& first, std::vector<MPI_Request>& second) {
  const int n = size();
  const int64_t capacity = message_capacity();
  uint8_t* in = round_recv_.data_ptr<uint8_t>();
  for (int p = 0; p < n; ++p) {
    if (p == rank_) continue;
    first.emplace_back();
    check(MPI_Irecv(in + p * capacity, static_cast<int>(capacity), MPI_BYTE, p, 0, round_comm_, &first.back()), op,
          "MPI_Irecv");
  }
  for (int p = 0; p < n; ++p) {
    if (p == rank_) continue;
    const at::Tensor* payload = payload_for ? payload_for(p) : nullptr;
    Header h = mine;
    h.inline_bytes = payload ? static_cast<int64_t>(payload->nbytes()) : 0;
    const int64_t total = static_cast<int64_t>(sizeof(Header)) + h.inline_bytes;
    const int64_t head = first_part(total);
    h.inline_after = static_cast<int32_t>(total - head);
    uint8_t* out = round_send_.data_ptr<uint8_t>() + p * capacity;
    std::memcpy(out, &h, sizeof(Header));
    if (h.inline_bytes > 0) std::memcpy(out + sizeof(Header), payload->data_ptr(), h.inline_bytes);
    first.emplace_back();
    check(MPI_Isend(out, static_cast<int>(head), MPI_BYTE, p, 0, round_comm_, &first.back()), op, "MPI_Isend");
    if (h.inline_after == 0) continue;
    second.emplace_back();
    check(MPI_Isend(out + head, h.inline_after, MPI_BYTE, p, 1, round_comm_, &second.back()), op, "MPI_Isend");
  }
}

// Reads the peers' headers out of their first messages, and posts the
// receive of each second message a header announces (whatever this rank
// expected: ranks that called different collectives still drain each other).
void MpiCommunicator::read_round_headers(Round& round, const char* op, std::vector<MPI_Request>& second) {
  const int n = size();
  const int64_t capacity = message_capacity();
  uint8_t* in = round_recv_.data_ptr<uint8_t>();
  for (int p = 0; p < n; ++p) {
    if (p == rank_) continue;
    std::memcpy(&round.headers[p], in + p * capacity, sizeof(Header));
    const Header& theirs = round.headers[p];
    if (theirs.magic != Header().magic || theirs.inline_bytes < 0 || theirs.inline_bytes > options_.inline_bytes ||
        theirs.inline_after < 0 || theirs.inline_after > theirs.inline_bytes) {
      abandoned_ = true;  // this rank's second messages may still be in flight
      abandon({round_send_, round_recv_});
      throw CommError(str_cat(where(op), ": malformed header from ", peer_name(p)));
    }
    if (theirs.inline_bytes > 0) round.payload[p] = in + p * capacity + sizeof(Header);
    if (theirs.inline_after == 0) continue;
    second.emplace_back();
    check(MPI_Irecv(in + p * capacity + sizeof(Header) + theirs.inline_bytes - theirs.inline_after,
                    theirs.inline_after, MPI_BYTE, p, 1, round_comm_, &second.back()),
          op, "MPI_Irecv");
  }
}

std::vector<Header> MpiCommunicator::allgather_headers(const Header& mine, const char* op) {
  const int n = size();
  Header* all = reinterpret_cast<Header*>(headers_.data_ptr());
  all[rank_] = mine;
  MPI_Request request;
  check(MPI_Iallgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, all, sizeof(Header), MPI_BYTE, comm_, &request), op,
        "MPI_Iallgather");
  wait(request, op, {});  // headers_ is the communicator's; abandoned with it after a timeout
  add_traffic(OpKind::kVerify, sizeof(Header), (n - 1) * static_cast<int64_t>(sizeof(Header)));
  return std::vector<Header>(all, all + n);
}

void MpiCommunicator::verify(const std::vector<Header>& all, const char* op, bool same_shape) const {
  const std::string problem = header_mismatch(all, same_shape, global_ranks());
  if (!problem.empty()) throw MismatchError(str_cat(where(op), ": ", problem));
}

void MpiCommunicator::add_traffic(OpKind kind, int64_t sent, int64_t received) {
  if (size() == 1) return;
  counter_.add_sent(kind, sent);
  counter_.add_received(kind, received);
}

int MpiCommunicator::mpi_count(int64_t numel, const char* op) const {
  MESHTRAIN_CHECK(numel <= INT_MAX, where(op), ": ", numel, " elements exceed MPI's int counts (2^31 - 1 elements); "
                  "split the tensor");
  return static_cast<int>(numel);
}

// ---- all_reduce, broadcast, reduce: in place

WorkPtr MpiCommunicator::start_all_reduce(at::Tensor tensor, ReduceOp op) {
  const int count = mpi_count(tensor.numel(), "all_reduce");
  return enqueue(OpKind::kAllReduce, "all_reduce", [this, tensor, op, count](std::vector<at::Tensor>& result) {
    at::Tensor data = contiguous(tensor);
    if (fits_round(data.nbytes())) {
      small_all_reduce(data, op);  // Note [MPI header round]
      if (!tensor.is_contiguous()) tensor.copy_(data);
      result = {tensor};
      return;
    }
    if (options_.verify) verify(exchange_headers(header_of(data, OpKind::kAllReduce, op), "all_reduce"), "all_reduce", true);
    MPI_Request request;
    check(MPI_Iallreduce(MPI_IN_PLACE, data.data_ptr(), count, datatype_of(data.scalar_type()),
                         op_for(data.scalar_type(), op), comm_, &request),
          "all_reduce", "MPI_Iallreduce");
    wait(request, "all_reduce", {data});
    if (op == ReduceOp::kAvg) data.div_(size());
    add_traffic(OpKind::kAllReduce, data.nbytes(), data.nbytes());
    if (!tensor.is_contiguous()) tensor.copy_(data);
    result = {tensor};
  });
}

// out := every rank's piece reduced in rank order (this rank's is `mine`, the
// peers' came in the round), the same bits on every rank; `out` may be `mine`
// (each element is read before it is written).
void MpiCommunicator::reduce_round(const at::Tensor& out, const at::Tensor& mine, const Round& round, ReduceOp op) {
  if (mine.numel() == 0) return;
  std::vector<const void*> inputs(size());
  for (int p = 0; p < size(); ++p) inputs[p] = p == rank_ ? mine.data_ptr() : round.payload[p];
  reduce_into(out.data_ptr(), inputs.data(), size(), mine.numel(), mine.scalar_type(),
              op == ReduceOp::kAvg ? ReduceOp::kSum : op);
  if (op == ReduceOp::kAvg) out.div_(size());
}

void MpiCommunicator::small_all_reduce(at::Tensor data, ReduceOp op) {
  Header h = header_of(data, OpKind::kAllReduce, op);
  h.inlined = 1;
  const Round round = header_round(h, "all_reduce", [&](int) { return &data; });
  verify(round.headers, "all_reduce", true);  // free here: the headers came anyway
  reduce_round(data, data, round, op);
  add_traffic(OpKind::kAllReduce, data.nbytes(), data.nbytes());
}

void MpiCommunicator::small_broadcast(at::Tensor data, int root) {
  Header h = header_of(data, OpKind::kBroadcast, ReduceOp::kSum, root);
  h.inlined = 1;
  const Round round = header_round(h, "broadcast", [&](int) { return rank_ == root ? &data : nullptr; });
  verify(round.headers, "broadcast", true);
  const int64_t bytes = data.nbytes();
  if (rank_ != root && bytes > 0) std::memcpy(data.data_ptr(), round.payload[root], bytes);
  add_traffic(OpKind::kBroadcast, rank_ == root ? bytes : 0, rank_ == root ? 0 : bytes);
}

// Each peer receives only its own shard of this rank's input; this rank's
// shard is every rank's contribution reduced in rank order.
void MpiCommunicator::small_reduce_scatter(const at::Tensor& flat, at::Tensor out, const std::vector<int64_t>& counts,
                                           ReduceOp op) {
  const int n = size();
  Header h = header_of(flat, OpKind::kReduceScatter, op);
  h.aux = hash_sizes(counts);
  h.inlined = 1;
  const auto offsets = offsets_of(counts);
  std::vector<at::Tensor> shards(n);
  for (int p = 0; p < n; ++p) shards[p] = flat.narrow(0, offsets[p], counts[p]);
  const Round round = header_round(h, "reduce_scatter", [&](int p) { return counts[p] > 0 ? &shards[p] : nullptr; });
  verify(round.headers, "reduce_scatter", true);
  const at::Tensor& mine = shards[rank_];
  if (mine.numel() > 0) {
    // reduce_round may write over `mine` itself, not over another part of the input.
    const bool direct = out.is_contiguous() && (out.data_ptr() == mine.data_ptr() || !overlap(out, flat));
    at::Tensor reduced = direct ? out : at::empty_like(mine);
    reduce_round(reduced, mine, round, op);
    if (!direct) out.copy_(reduced.view(out.sizes()));
  }
  const int64_t elem = flat.element_size();
  add_traffic(OpKind::kReduceScatter, (flat.numel() - counts[rank_]) * elem, counts[rank_] * elem);
}

WorkPtr MpiCommunicator::start_broadcast(at::Tensor tensor, int root) {
  const int count = mpi_count(tensor.numel(), "broadcast");
  return enqueue(OpKind::kBroadcast, "broadcast", [this, tensor, root, count](std::vector<at::Tensor>& result) {
    at::Tensor data = contiguous(tensor);
    if (fits_round(data.nbytes())) {
      small_broadcast(data, root);  // Note [MPI header round]
      if (!tensor.is_contiguous()) tensor.copy_(data);
      result = {tensor};
      return;
    }
    if (options_.verify) {
      verify(exchange_headers(header_of(data, OpKind::kBroadcast, ReduceOp::kSum, root), "broadcast"), "broadcast", true);
    }
    MPI_Request request;
    check(MPI_Ibcast(data.data_ptr(), count, datatype_of(data.scalar_type()), root, comm_, &request), "broadcast",
          "MPI_Ibcast");
    wait(request, "broadcast", {data});
    const int64_t bytes = data.nbytes();
    add_traffic(OpKind::kBroadcast, rank_ == root ? bytes : 0, rank_ == root ? 0 : bytes);
    if (!tensor.is_contiguous()) tensor.copy_(data);
    result = {tensor};
  });
}

WorkPtr MpiCommunicator::start_reduce(at::Tensor tensor, int root, ReduceOp op) {
  const int count = mpi_count(tensor.numel(), "reduce");
  return enqueue(OpKind::kReduce, "reduce", [this, tensor, root, op, count](std::vector<at::Tensor>& result) {
    at::Tensor data = contiguous(tensor);
    if (options_.verify) verify(exchange_headers(header_of(data, OpKind::kReduce, op, root), "reduce"), "reduce", true);
    const bool is_root = rank_ == root;
    MPI_Request request;
    check(MPI_Ireduce(is_root ? MPI_IN_PLACE : data.data_ptr(), is_root ? data.data_ptr() : nullptr, count,
                      datatype_of(data.scalar_type()), op_for(data.scalar_type(), op), root, comm_, &request),
          "reduce", "MPI_Ireduce");
    wait(request, "reduce", {data});
    const int64_t bytes = data.nbytes();
    add_traffic(OpKind::kReduce, is_root ? 0 : bytes, is_root ? bytes : 0);
    if (is_root) {
      if (op == ReduceOp::kAvg) data.div_(size());
      if (!tensor.is_contiguous()) tensor.copy_(data);
    }
    result = {tensor};
  });
}

// ---- all_gather (and split's exchange)

void MpiCommunicator::gather_flat(const at::Tensor& input, const at::Tensor& output, bool splitting,
                                  std::vector<at::Tensor>& result) {
  const int n = size(), me = rank_;
  const char* op = splitting ? "split" : "all_gather";
  const at::Tensor mine = contiguous(input);
  Header h = header_of(mine, OpKind::kAllGather);
  h.aux = splitting ? kSplitting : output.defined() ? output.numel() : -1;
  h.inlined = fits_round(mine.nbytes()) ? 1 : 0;  // sizes may differ: each rank inlines what fits
  const Round round = header_round(h, op, [&](int) { return h.inlined ? &mine : nullptr; });
  const std::vector<Header>& all = round.headers;
  auto name = [&](int q) { return all[q].aux == kSplitting ? "split" : "all_gather"; };
  for (int q = 1; q < n; ++q) {
    if ((all[q].aux == kSplitting) != (all[0].aux == kSplitting)) {
      throw MismatchError(str_cat(where(op), ": rank ", q, " called ", name(q), " while rank 0 called ", name(0),
                                  " (every rank must call collectives in the same order)"));
    }
  }
  std::vector<Header> kinds = all;  // sizes may differ by rank; kinds and dtypes may not
  for (auto& k : kinds) k.aux = k.inlined = 0;
  verify(kinds, op, false);
  std::vector<int64_t> counts(n);
  int64_t total = 0;
  for (int q = 0; q < n; ++q) total += counts[q] = all[q].numel;
  for (int q = 0; q < n; ++q) {
    if (all[q].aux >= 0 && all[q].aux != total) {
      throw MismatchError(str_cat(where(op), ": rank ", q, " passed an output of ", all[q].aux,
                                  " elements but the inputs total ", total));
    }
  }
  mpi_count(total, op);
  at::Tensor flat = output.defined() && output.is_contiguous() ? output.view(-1) : at::empty({total}, input.options());
  const auto offsets = offsets_of(counts);
  const int64_t elem = mine.element_size();
  char* my_slot = bytes_of(flat) + offsets[me] * elem;  // the input may be this very slot (in place)
  if (mine.nbytes() > 0 && my_slot != bytes_of(mine)) std::memmove(my_slot, mine.data_ptr(), mine.nbytes());
  const bool every_rank_inlined = std::all_of(all.begin(), all.end(), [](const Header& x) { return x.inlined != 0; });
  if (every_rank_inlined) {  // the round was the collective (Note [MPI header round])
    for (int q = 0; q < n; ++q) {
      if (q != me && counts[q] > 0) std::memcpy(bytes_of(flat) + offsets[q] * elem, round.payload[q], counts[q] * elem);
    }
    finish_gather(input, output, flat, all, counts, result);
    return;
  }
  const MPI_Datatype type = datatype_of(input.scalar_type());
  at::Tensor rcounts = int_array(counts), displs = int_array(offsets);
  MPI_Request request;
  if (all_equal(counts)) {
    check(MPI_Iallgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, flat.data_ptr(), static_cast<int>(counts[0]), type, comm_,
                         &request),
          op, "MPI_Iallgather");
  } else {
    check(MPI_Iallgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, flat.data_ptr(), ints(rcounts), ints(displs), type,
                          comm_, &request),
          op, "MPI_Iallgatherv");
  }
  wait(request, op, {flat, rcounts, displs});
  finish_gather(input, output, flat, all, counts, result);
}

void MpiCommunicator::finish_gather(const at::Tensor& input, const at::Tensor& output, const at::Tensor& flat,
                                    const std::vector<Header>& all, const std::vector<int64_t>& counts,
                                    std::vector<at::Tensor>& result) {
  const int64_t elem = input.element_size(), total = flat.numel();
  add_traffic(OpKind::kAllGather, counts[rank_] * elem, (total - counts[rank_]) * elem);
  if (output.defined() && !output.is_contiguous()) output.copy_(flat.view(output.sizes()));
  result = {output.defined() ? output : flat};
  const auto offsets = offsets_of(counts);
  for (int q = 0; q < size(); ++q) result.push_back(view_at(flat, offsets[q], shape_of(all[q])));
}

WorkPtr MpiCommunicator::start_all_gather(const at::Tensor& input, at::Tensor output) {
  return enqueue(OpKind::kAllGather, "all_gather", [this, input, output](std::vector<at::Tensor>& result) {
    gather_flat(input, output, /*splitting=*/false, result);
  });
}

// ---- reduce_scatter

WorkPtr MpiCommunicator::start_reduce_scatter(const at::Tensor& input, ReduceOp op, at::Tensor output,
                                              std::vector<int64_t> counts) {
  mpi_count(input.numel(), "reduce_scatter");
  return enqueue(OpKind::kReduceScatter, "reduce_scatter",
                 [this, input, op, output, counts](std::vector<at::Tensor>& result) {
    const at::Tensor flat = input.contiguous().view(-1);
    if (fits_round(*std::max_element(counts.begin(), counts.end()) * flat.element_size())) {
      at::Tensor out = output.defined() ? output : at::empty({counts[rank_]}, input.options());
      small_reduce_scatter(flat, out, counts, op);  // Note [MPI header round]
      result = {out};
      return;
    }
    if (options_.verify) {
      Header h = header_of(flat, OpKind::kReduceScatter, op);
      h.aux = hash_sizes(counts);
      verify(exchange_headers(h, "reduce_scatter"), "reduce_scatter", true);
    }
    // MPI's send and receive buffers may not overlap; ZeRO's output is often this rank's shard of the input.
    const bool direct = output.defined() && output.is_contiguous() && !overlap(output, flat);
    at::Tensor out = direct ? output.view(-1) : at::empty({counts[rank_]}, input.options());
    const MPI_Datatype type = datatype_of(input.scalar_type());
    const MPI_Op mpi_op = op_for(input.scalar_type(), op);
    at::Tensor rcounts = int_array(counts);
    MPI_Request request;
    if (all_equal(counts)) {
      check(MPI_Ireduce_scatter_block(flat.data_ptr(), out.data_ptr(), static_cast<int>(counts[0]), type, mpi_op, comm_,
                                      &request),
            "reduce_scatter", "MPI_Ireduce_scatter_block");
    } else {
      check(MPI_Ireduce_scatter(flat.data_ptr(), out.data_ptr(), ints(rcounts), type, mpi_op, comm_, &request),
            "reduce_scatter", "MPI_Ireduce_scatter");
    }
    wait(request, "reduce_scatter", {flat, out, rcounts});
    if (op == ReduceOp::kAvg) out.div_(size());
    const int64_t elem = input.element_size();
    add_traffic(OpKind::kReduceScatter, (flat.numel() - counts[rank_]) * elem, counts[rank_] * elem);
    if (output.defined() && !direct) output.copy_(out.view(output.sizes()));
    result = {output.defined() ? output : out};
  });
}

// ---- gather, scatter

WorkPtr MpiCommunicator::start_gather(const at::Tensor& input, int root) {
  mpi_count(input.numel(), "gather");
  return enqueue(OpKind::kGather, "gather", [this, input, root](std::vector<at::Tensor>& result) {
    const int n = size();
    const at::Tensor data = input.contiguous();
    const std::vector<Header> all = exchange_headers(header_of(data, OpKind::kGather, ReduceOp::kSum, root), "gather");
    verify(all, "gather", false);  // sizes are needed whether or not options_.verify
    const MPI_Datatype type = datatype_of(input.scalar_type());
    std::vector<int64_t> counts(n);
    int64_t total = 0;
    for (int q = 0; q < n; ++q) total += counts[q] = all[q].numel;
    const int64_t elem = input.element_size();
    MPI_Request request;
    result.clear();
    if (rank_ != root) {
      check(MPI_Igatherv(data.data_ptr(), static_cast<int>(data.numel()), type, nullptr, nullptr, nullptr, type, root,
                         comm_, &request),
            "gather", "MPI_Igatherv");
      wait(request, "gather", {data});
      add_traffic(OpKind::kGather, data.numel() * elem, 0);
      return;
    }
    mpi_count(total, "gather");
    const auto offsets = offsets_of(counts);
    at::Tensor flat = at::empty({total}, input.options());
    flat.narrow(0, offsets[root], counts[root]).copy_(data.view(-1));
    at::Tensor rcounts = int_array(counts), displs = int_array(offsets);
    check(MPI_Igatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, flat.data_ptr(), ints(rcounts), ints(displs), type, root,
                       comm_, &request),
          "gather", "MPI_Igatherv");
    wait(request, "gather", {flat, rcounts, displs});
    add_traffic(OpKind::kGather, 0, (total - counts[root]) * elem);
    for (int q = 0; q < n; ++q) result.push_back(flat.narrow(0, offsets[q], counts[q]).view(shape_of(all[q])));
  });
}

WorkPtr MpiCommunicator::start_scatter(at::Tensor output, std::vector<at::Tensor> inputs, int root) {
  return enqueue(OpKind::kScatter, "scatter", [this, output, inputs, root](std::vector<at::Tensor>& result) {
    Header mine = header_of(output, OpKind::kScatter, ReduceOp::kSum, root);
    std::vector<int64_t> in_sizes;
    for (const auto& t : inputs) in_sizes.push_back(t.numel());
    if (rank_ == root) mine.aux = hash_sizes(in_sizes);
    const std::vector<Header> all = exchange_headers(mine, "scatter");
    std::vector<Header> kinds = all;
    for (auto& h : kinds) h.aux = 0;
    verify(kinds, "scatter", false);
    std::vector<int64_t> out_sizes;
    for (const auto& h : all) out_sizes.push_back(h.numel);
    if (hash_sizes(out_sizes) != all[root].aux) {
      throw MismatchError(str_cat(where("scatter"), ": the root's inputs do not match the ranks' output sizes"));
    }
    at::Tensor out = output.is_contiguous() ? output : at::empty_like(output, at::MemoryFormat::Contiguous);
    const MPI_Datatype type = datatype_of(output.scalar_type());
    const int64_t elem = output.element_size();
    MPI_Request request;
    if (rank_ == root) {
      std::vector<at::Tensor> flats;
      for (const auto& t : inputs) flats.push_back(t.reshape({-1}));
      at::Tensor send = at::cat(flats);
      mpi_count(send.numel(), "scatter");
      at::Tensor scounts = int_array(out_sizes), displs = int_array(offsets_of(out_sizes));
      check(MPI_Iscatterv(send.data_ptr(), ints(scounts), ints(displs), type, MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, root,
                          comm_, &request),
            "scatter", "MPI_Iscatterv");
      wait(request, "scatter", {send, scounts, displs});
      out.view(-1).copy_(flats[root]);
      add_traffic(OpKind::kScatter, (send.numel() - out_sizes[root]) * elem, 0);
    } else {
      check(MPI_Iscatterv(nullptr, nullptr, nullptr, type, out.data_ptr(), mpi_count(out.numel(), "scatter"), type, root,
                          comm_, &request),
            "scatter", "MPI_Iscatterv");
      wait(request, "scatter", {out});
      add_traffic(OpKind::kScatter, 0, out.numel() * elem);
    }
    if (!output.is_contiguous()) output.copy_(out);
    result = {output};
  });
}

// ---- all_to_all: the pieces' headers (their shapes), then the pieces

WorkPtr MpiCommunicator::start_all_to_all(std::vector<at::Tensor> inputs) {
  return enqueue(OpKind::kAllToAll, "all_to_all", [this, inputs](std::vector<at::Tensor>& result) {
    const int n = size(), me = rank_;
    if (options_.verify) verify(exchange_headers(header_of(inputs[0], OpKind::kAllToAll), "all_to_all"), "all_to_all", false);
    constexpr int64_t kH = sizeof(Header);
    at::Tensor out_headers = at::empty({n * kH}, at::kByte), in_headers = at::empty({n * kH}, at::kByte);
    std::vector<at::Tensor> flats;
    std::vector<int64_t> send_counts(n), recv_counts(n);
    for (int q = 0; q < n; ++q) {
      flats.push_back(inputs[q].reshape({-1}));
      send_counts[q] = inputs[q].numel();
      reinterpret_cast<Header*>(out_headers.data_ptr())[q] = header_of(inputs[q], OpKind::kAllToAll);
    }
    MPI_Request request;
    check(MPI_Ialltoall(out_headers.data_ptr(), kH, MPI_BYTE, in_headers.data_ptr(), kH, MPI_BYTE, comm_, &request),
          "all_to_all", "MPI_Ialltoall");
    wait(request, "all_to_all", {out_headers, in_headers});
    add_traffic(OpKind::kVerify, (n - 1) * kH, (n - 1) * kH);
    const Header* theirs = reinterpret_cast<const Header*>(in_headers.data_ptr());
    for (int q = 0; q < n; ++q) {
      if (theirs[q].kind != static_cast<int32_t>(OpKind::kAllToAll) || theirs[q].dtype != static_cast<int32_t>(inputs[0].scalar_type())) {
        throw MismatchError(str_cat(where("all_to_all"), ": ", peer_name(q), " sends ",
                                    theirs[q].kind == static_cast<int32_t>(OpKind::kAllToAll) ? describe(theirs[q]) : op_name(static_cast<OpKind>(theirs[q].kind)),
                                    " but this rank's inputs are ", inputs[0].scalar_type()));
      }
      recv_counts[q] = theirs[q].numel;
    }
    at::Tensor send = at::cat(flats);
    const auto recv_offsets = offsets_of(recv_counts);
    at::Tensor recv = at::empty({recv_offsets.back() + recv_counts.back()}, inputs[0].options());
    mpi_count(std::max(send.numel(), recv.numel()), "all_to_all");
    at::Tensor sc = int_array(send_counts), sd = int_array(offsets_of(send_counts));
    at::Tensor rc = int_array(recv_counts), rd = int_array(recv_offsets);
    const MPI_Datatype type = datatype_of(inputs[0].scalar_type());
    check(MPI_Ialltoallv(send.data_ptr(), ints(sc), ints(sd), type, recv.data_ptr(), ints(rc), ints(rd), type, comm_,
                         &request),
          "all_to_all", "MPI_Ialltoallv");
    wait(request, "all_to_all", {send, recv, sc, sd, rc, rd});
    const int64_t elem = inputs[0].element_size();
    add_traffic(OpKind::kAllToAll, (send.numel() - send_counts[me]) * elem, (recv.numel() - recv_counts[me]) * elem);
    result.clear();
    for (int q = 0; q < n; ++q) result.push_back(recv.narrow(0, recv_offsets[q], recv_counts[q]).view(shape_of(theirs[q])));
  });
}

// ---- barrier

WorkPtr MpiCommunicator::start_barrier() {
  return enqueue(OpKind::kBarrier, "barrier", [this](std::vector<at::Tensor>&) {
    if (options_.verify) {
      // An all-gather completes only once every rank has joined it: the verification round is the barrier.
      verify(exchange_headers(header_of(at::Tensor(), OpKind::kBarrier), "barrier"), "barrier", true);
      return;
    }
    MPI_Request request;
    check(MPI_Ibarrier(comm_, &request), "barrier", "MPI_Ibarrier");
    wait(request, "barrier", {});
  });
}

}  // namespace mpi_backend
}  // namespace comm
}  // namespace meshtrain
