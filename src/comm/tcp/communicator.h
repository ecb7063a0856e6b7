#pragma once
// TcpCommunicator: the Communicator for ranks that reach one another over
// TCP (not c10d's ProcessGroupGloo, whose worker-thread hand-offs cost ~2.6 ms
// per small all-reduce here). Collectives are our own algorithms over
// messages addressed by (peer, slot) (ring reduce-scatter / all-gather /
// all-reduce, direct sends for the rest), so that every byte is counted, every
// wait has a timeout and failure hook, and reduce-scatter exists at all (gloo
// in libtorch 1.13 has none). The messages travel over meshtrain's TCP links
// (tcp/links.h): Note [Gloo transports].
//
// Execution (QueuedCommunicator): one operation at a time, in submission order;
// the running operation's sequence number, identical on every rank, names its
// message slots.

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "../header.h"
#include "../process.h"
#include "../queued.h"
#include "links.h"
#include "doubling.h"

namespace meshtrain {
namespace comm {
namespace gloo_backend {

// The slot index (collective_slot) of every collective's header round.
constexpr int kHeaderSub = 0xffff;

// What the first round of a collective delivered. See Note [Header round].
struct Round {
  std::vector<Header> headers;          // every rank's, this rank's included
  std::vector<const uint8_t*> payload;  // inline payload received from each peer, or nullptr (valid until the next operation)
  // A folding round's result for this rank (all_reduce: the whole; reduce_scatter:
  // its shard), or nullptr (Note [Folding round]; valid until the next operation).
  const uint8_t* folded = nullptr;
};

// A payload that rides inline in the header round: bytes of a contiguous
// tensor, or none (data nullptr). Plain bytes, not a tensor view: a view costs
// a trip through the dispatcher per peer, on every small collective.
struct InlineBytes {
  const uint8_t* data = nullptr;
  int64_t bytes = 0;
  bool operator==(const InlineBytes& o) const { return data == o.data && bytes == o.bytes; }
};
inline InlineBytes inline_bytes_of(const at::Tensor& t) {
  return InlineBytes{static_cast<const uint8_t*>(t.data_ptr()), static_cast<int64_t>(t.nbytes())};
}

// How a collective opens (see Note [Collective skeleton]): the header this rank
// sends in the header round, what rides inline with it, and how every rank's
// header is compared.
struct Opening {
  explicit Opening(const Header& h) : header(h) {}

  Header header;
  // This rank's payload for peer p, sent in the same message; data nullptr: none.
  std::function<InlineBytes(int)> inline_for;
  // The round runs even with CommOptions::verify off: it carries payloads, or
  // sizes that differ by rank.
  bool needed = false;
  bool same_shape = true;  // every rank must pass the same shape (not for uneven gathers)
  // The algorithm needs nothing from the round: on the TCP links it may post
  // its first messages before the round completes (Note [Verification beside the data]).
  bool deferrable = false;
  // Clears the fields that may differ by rank before the comparison.
  void (*ignore)(Header&) = nullptr;
  // A doubling round reduces the payloads as it goes (all_reduce, reduce_scatter:
  // Note [Folding round]); set where the round goes by doubling (TcpCommunicator::may_fold).
  bool fold = false;
};

// A running collective, as the skeleton hands it to an algorithm.
struct Collective {
  at::Tensor work;     // this rank's data, contiguous (the caller's tensor when it already is)
  bool small = false;  // this rank's payload rides in the header round
  Round round;         // empty when the round did not run
};

// Where an in-place collective's data flows: who sends its payload in the
// header round when it fits, and whose tensor receives a result.
enum class Flow {
  kEveryRank,  // all_reduce: every rank's data reaches every rank
  kFromRoot,   // broadcast
  kToRoot,     // reduce: only the root's tensor changes
};

// An in-place collective (all_reduce, broadcast, reduce): its result replaces its input.
struct InPlace {
  OpKind kind;
  const char* name;
  ReduceOp op;
  int root;
  Flow flow;
};

// One posted send or receive on the links.
struct Transfer {
  Posted req;  // withdrawn if dropped unfinished (an error path)
  int peer = -1;
  bool is_recv = false;
  size_t bytes = 0;
  OpKind kind = OpKind::kSend;
  const char* op = "";  // the operation it belongs to, for error messages
};

// A header round posted but not yet waited for (Note [Verification beside the data]).
struct PendingRound {
  std::vector<Transfer> transfers;
  std::vector<int64_t> inline_sent;  // by peer
  Header mine;
  const char* op = "";
  bool same_shape = true;
  void (*ignore)(Header&) = nullptr;
};

class TcpCommunicator final : public QueuedCommunicator {
 public:
  TcpCommunicator(std::shared_ptr<Process> process, std::vector<int> global_ranks,
                   int rank, const std::string& store_prefix, CommOptions options);
  ~TcpCommunicator() override;

  std::string backend() const override { return "gloo"; }

  std::shared_ptr<Communicator> split(int color, int key, const std::string& label) override;

 protected:
  WorkPtr start_send(const at::Tensor& tensor, int dst, int tag) override;
  WorkPtr start_recv(at::Tensor tensor, int src, int tag) override;
  WorkPtr start_recv_any(int src, int tag) override;

  WorkPtr start_broadcast(at::Tensor tensor, int root) override;
  WorkPtr start_all_reduce(at::Tensor tensor, ReduceOp op) override;
  WorkPtr start_reduce(at::Tensor tensor, int root, ReduceOp op) override;
  WorkPtr start_all_gather(const at::Tensor& input, at::Tensor output) override;
  WorkPtr start_reduce_scatter(const at::Tensor& input, ReduceOp op, at::Tensor output,
                               std::vector<int64_t> counts) override;
  WorkPtr start_gather(const at::Tensor& input, int root) override;
  WorkPtr start_scatter(at::Tensor output, std::vector<at::Tensor> inputs, int root) override;
  WorkPtr start_all_to_all(std::vector<at::Tensor> inputs) override;
  WorkPtr start_barrier() override;

 private:
  // ---- transfers (communicator.cpp)
  uint64_t collective_slot(int sub) const;
  // `hold`: the message waits for the next one to `peer`
  // and leaves with it (tcp::Links::send).
  Transfer post_send(const void* ptr, size_t bytes, int peer, uint64_t slot, OpKind kind, bool hold = false);
  Transfer post_recv(void* ptr, size_t bytes, int peer, uint64_t slot, OpKind kind);
  // A transfer's bookkeeping (peer, direction, size, kind, the operation named in errors), before it is posted.
  Transfer describe_transfer(int peer, bool is_recv, size_t bytes, OpKind kind) const;
  // Waits for `t` up to the communicator's timeout; a TimeoutError, or a
  // PeerFailure naming the dead rank, otherwise.
  void wait(Transfer& t);
  // How long a wait runs before it is recorded (Note [Naming a stuck rank]).
  std::chrono::steady_clock::duration long_wait() const {
    return std::max<std::chrono::steady_clock::duration>(std::chrono::seconds(1), options_.timeout / 4);
  }
  void connect_links();
  void throw_failed_peer_if_any() const;
  [[noreturn]] void throw_timeout(const Transfer& t) const;
  [[noreturn]] void throw_broken_connection(const Transfer& t, const std::string& what) const;
  [[noreturn]] void throw_aborted(const Transfer& t) const;
  void wait_all(std::vector<Transfer>& transfers);
  // Sends `t` to `peer` in slot 0 of the running collective and waits for it.
  void send_and_wait(const at::Tensor& t, int peer, OpKind kind);
  // Counts payload bytes exchanged with `peer` under `kind` (and apart when
  // the peer is on another host).
  void count(OpKind kind, int peer, int64_t sent, int64_t received);

  // ---- the skeleton (collectives.cpp; see Note [Collective skeleton])
  // Sends `mine` to every peer, with payload inline_for(peer) (or none) in the
  // same message; receives every peer's. One round of small messages.
  Round header_round(const Header& mine, const std::function<InlineBytes(int)>& inline_for);
  // `hold`: the headers leave with the algorithm's first messages (Note [Verification beside the data]).
  PendingRound post_header_round(const Header& mine, const std::function<InlineBytes(int)>& inline_for,
                                 bool hold = false);
  Round finish_header_round(PendingRound& pending);
  // The header round by recursive doubling (Note [Doubling round] in doubling.h), where doubling_:
  // the same Round as header_round; a MismatchError on every rank of a round with another pattern too.
  Round doubling_round(const char* op, const Opening& opening);
  RoundEntry own_entry(const Opening& opening) const;
  Partials own_partials(const Opening& opening);
  std::vector<RoundPiece> own_pieces(const Opening& opening, bool with_own) const;
  // Whether a small collective of `dtype` with its payload in the round folds it.
  bool may_fold(at::ScalarType dtype) const { return doubling_ && folds(dtype); }
  Transfer send_step(const RoundMessage& m, int step, int partner, const Opening& opening);
  std::string receive_step(Transfer& in, int step, int partner, const char* op, const Opening& opening,
                           std::vector<RoundEntry>& held);
  std::string known_mismatch(const std::vector<RoundEntry>& held, const Opening& opening) const;
  [[noreturn]] void alarm_and_raise(const std::string& what, const Opening& opening,
                                    const std::vector<RoundEntry>& held, const std::vector<bool>& sent,
                                    std::vector<Transfer>& sends);
  Round round_of(const std::vector<RoundEntry>& held, const Opening& opening) const;
  // Waits for a deferred round and verifies it (MismatchError); nothing when none is pending.
  void settle_round();
  // What the round posts to receive from each peer: a header and the most inline payload.
  int64_t round_capacity() const { return static_cast<int64_t>(sizeof(Header)) + options_.inline_bytes; }
  void prepare_round_buffers();
  // Writes `mine` and `payload` (or none) into the message to `peer`; returns the payload's bytes.
  int64_t write_round_message(int peer, const Header& mine, InlineBytes payload);
  // Checks and counts `peer`'s message, and records its header and payload in `round`.
  void read_round_message(Round& round, int peer, int64_t inline_sent, OpKind kind);
  bool fits_inline(int64_t bytes) const { return bytes <= options_.inline_bytes; }
  void verify_same(const std::vector<Header>& all, const char* op, bool same_shape) const;
  // The header round when `opening` needs it or verification is on, then the
  // comparison; an empty Round when the round did not run.
  Round open(const char* op, const Opening& opening);
  // Enqueues an in-place collective: contiguous work tensor, open(), the
  // algorithm, the result copied back into a non-contiguous tensor.
  WorkPtr in_place(at::Tensor tensor, const InPlace& spec, std::function<void(Collective&)> algorithm);
  InlineBytes inline_payload(const InPlace& spec, const Collective& c, int peer) const;
  // The openings of the collectives whose outputs differ from their inputs.
  Collective open_reduce_scatter(const at::Tensor& input, ReduceOp op, const std::vector<int64_t>& counts);
  Collective open_all_gather(const at::Tensor& input, const at::Tensor& output);
  std::vector<int64_t> all_gather_counts(const std::vector<Header>& all) const;
  Collective open_gather(const at::Tensor& input, int root);
  Round open_scatter(const at::Tensor& output, const std::vector<at::Tensor>& sources, int root);
  std::vector<Header> exchange_pair_headers(const std::vector<at::Tensor>& inputs);
  void check_pair_headers(const std::vector<Header>& theirs, at::ScalarType dtype) const;

  // ---- each collective's algorithm (algorithms.cpp; see Note [Gloo algorithms])
  void all_reduce_algorithm(Collective& c, ReduceOp op);
  void broadcast_algorithm(Collective& c, int root);
  void reduce_algorithm(Collective& c, int root, ReduceOp op);
  void reduce_scatter_algorithm(const Collective& c, at::Tensor out, const std::vector<int64_t>& counts,
                                ReduceOp op);
  void all_gather_algorithm(const Collective& c, at::Tensor flat_out, const std::vector<int64_t>& counts);
  std::vector<at::Tensor> gather_on_root(const Collective& c, int root);
  void scatter_algorithm(const Round& round, const std::vector<at::Tensor>& sources, at::Tensor out, int root);
  std::vector<at::Tensor> all_to_all_direct(const std::vector<at::Tensor>& inputs,
                                            const std::vector<Header>& theirs);
  // Whether the root sends a scatter piece inline (else in a message of its own).
  bool scatter_inlines(const at::Tensor& piece) const { return piece.numel() > 0 && fits_inline(piece.nbytes()); }

  // ---- the algorithms' building blocks (algorithms.cpp)
  void reduce_received(at::Tensor work, int root, ReduceOp op);
  void broadcast_direct(at::Tensor work, int root);
  // Root to rank +1 to rank +2 ..., in pieces each rank forwards as it
  // receives them (Note [Broadcast down a chain]).
  void broadcast_chain(at::Tensor work, int root);
  // Reduce-scatter and all-gather in pieces, each reduced and sent on as it
  // arrives (Note [Pipelined all-reduce]).
  void direct_all_reduce(at::Tensor flat, ReduceOp op);
  void ring_all_reduce(at::Tensor flat, ReduceOp op);
  void ring_reduce_scatter(const at::Tensor& flat_in, at::Tensor out,
                           const std::vector<int64_t>& counts, ReduceOp op);
  void ring_all_gather(at::Tensor flat_out, const std::vector<int64_t>& counts);
  // One ring step in slot `sub`: receives `recv` from the left neighbour while
  // sending `send` to the right one (either may be empty: no message).
  void ring_step(const at::Tensor& recv, const at::Tensor& send, int sub, OpKind kind);
  // Direct algorithms: every pair exchanges at once, in one round of n - 1
  // concurrent messages each way (the ring's bytes, in one round instead of n - 1).
  void direct_reduce_scatter(const at::Tensor& flat_in, void* out, const std::vector<int64_t>& counts, ReduceOp op);
  void direct_all_gather(at::Tensor flat_out, const std::vector<int64_t>& counts);
  // Temporary space of the running operation, `numel` elements of `like`'s
  // dtype at element `offset` of one buffer kept across operations: a page
  // fault costs ~15 us in a VM, and a fresh 16 MiB temporary per call (which
  // glibc maps and unmaps) costs 60 ms of them.
  at::Tensor scratch(int64_t offset, int64_t numel, const at::Tensor& like);
  // Ring or direct for a collective of `bytes` (see Note [Gloo algorithms]).
  bool use_ring(int64_t bytes) const { return size() > 2 && bytes >= options_.tuning.tcp.ring_bytes; }
  bool use_chain(int64_t bytes) const { return size() > 2 && bytes >= options_.tuning.tcp.chain_bytes; }

  std::shared_ptr<Process> process_;
  // The wire: meshtrain's TCP links (Note [Gloo transports]), set up here;
  // every algorithm's messages go through transport() (post_send, post_recv,
  // wait), the Transport interface (comm/transport.h) the links implement.
  std::unique_ptr<tcp::Links> links_;
  Transport* transport() const { return links_.get(); }
  std::string prefix_;
  int splits_ = 0;
  std::vector<bool> remote_;  // per member: on another host
  // Reused buffers of the header round (one per peer), sized header + inline_bytes.
  std::vector<at::Tensor> round_send_, round_recv_;
  // Header rounds go by doubling: the links, n = 2^L in 4..64, TcpTuning::doubling_round.
  bool doubling_ = false;
  std::vector<std::vector<uint8_t>> doubling_send_, doubling_recv_;  // per step, reused
  std::vector<uint8_t> alarm_buffer_;
  std::vector<uint8_t> fold_buffer_;  // a folding round's partial results, reused
  at::Tensor scratch_;  // see scratch()
  std::unique_ptr<PendingRound> pending_;  // a deferred header round, settled by the next wait
};

}  // namespace gloo_backend
}  // namespace comm
}  // namespace meshtrain
