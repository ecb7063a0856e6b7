// TcpCommunicator::doubling_round: the header round by recursive doubling,
// on the TCP links (Note [Doubling round] in doubling.h). It returns the same
// Round as the direct header_round (collectives.cpp), so the collectives'
// algorithms do not know which ran.

#include <cstring>
#include <string>

#include "communicator.h"
#include "doubling.h"
#include "../reduce.h"
#include "meshtrain/comm.h"
#include "meshtrain/util.h"

namespace meshtrain {
namespace comm {
namespace gloo_backend {

namespace {

int64_t payload_bytes(const RoundMessage& m) {
  int64_t total = 0;
  for (const RoundEntry& e : m.entries) {
    for (const RoundPiece& p : e.pieces) total += p.bytes;
  }
  return total;
}

}  // namespace

Round TcpCommunicator::doubling_round(const char* op, const Opening& opening) {
  const int n = size(), steps = doubling_steps(n);
  if (static_cast<int>(doubling_recv_.size()) != steps) {
    doubling_recv_.assign(steps, {});
    doubling_send_.assign(steps, {});
    for (int k = 0; k < steps; ++k) doubling_recv_[k].resize(doubling_capacity(n, k, options_.inline_bytes));
  }
  std::vector<RoundEntry> held(n);
  held[rank_] = own_entry(opening);
  Partials partials;
  if (opening.fold) partials = own_partials(opening);
  std::vector<Transfer> sends;
  std::vector<bool> sent(n, false);
  for (int k = 0; k < steps; ++k) {
    const int partner = doubling_partner(rank_, k);
    Transfer in = post_recv(doubling_recv_[k].data(), doubling_recv_[k].size(), partner,
                            collective_slot(kHeaderSub), OpKind::kVerify);
    sends.push_back(send_step(step_message(opening.header, held, rank_, k, opening.fold ? &partials.pieces : nullptr),
                              k, partner, opening));
    sent[partner] = true;
    std::string problem = receive_step(in, k, partner, op, opening, held);
    if (problem.empty() && opening.fold) {  // headers agree so far: the partials have this rank's sizes
      problem = fold_step(partials, held[partner].pieces, rank_, k);
      if (!problem.empty()) problem = str_cat(where(op), ": ", peer_name(partner), " sent ", problem);
      held[partner].pieces.clear();
    }
    if (!problem.empty()) alarm_and_raise(problem, opening, held, sent, sends);
  }
  wait_all(sends);
  Round round = round_of(held, opening);
  if (opening.fold) {
    // What is left is this rank's result: the whole (all_reduce), its own shard, or nothing (an empty one).
    if (partials.pieces.size() > 1 || (partials.pieces.size() == 1 && partials.pieces[0].dest >= 0 &&
                                       partials.pieces[0].dest != rank_)) {
      throw CommError(str_cat(where(op), ": a folding round ended with results for other ranks (a bug)"));
    }
    if (!partials.pieces.empty()) round.folded = partials.pieces[0].data;
  }
  return round;
}

// A folding round's start (Note [Folding round]): this rank's own data as the
// partial results, one for all or one per destination (its own shard
// included), each combined into its place in fold_buffer_.
Partials TcpCommunicator::own_partials(const Opening& opening) {
  Partials p;
  p.dtype = static_cast<at::ScalarType>(opening.header.dtype);
  p.op = summing(static_cast<ReduceOp>(opening.header.op));  // avg: the algorithm divides at the end
  p.pieces = own_pieces(opening, /*with_own=*/true);
  int64_t total = 0;
  for (const RoundPiece& piece : p.pieces) total += piece.bytes;
  fold_buffer_.resize(total);
  int64_t at = 0;
  for (const RoundPiece& piece : p.pieces) {
    p.into.push_back(fold_buffer_.data() + at);
    at += piece.bytes;
  }
  return p;
}

// This rank's entry: its header, and its payloads unless the round folds them.
RoundEntry TcpCommunicator::own_entry(const Opening& opening) const {
  RoundEntry e;
  e.known = true;
  e.header = opening.header;
  e.header.inline_bytes = 0;
  if (!opening.fold) e.pieces = own_pieces(opening, /*with_own=*/false);
  return e;
}

// One payload for every destination when inline_for gives the same tensor for
// each (all_gather, all_reduce, broadcast), else one per destination; this
// rank's own destination only `with_own` (a fold's own share).
std::vector<RoundPiece> TcpCommunicator::own_pieces(const Opening& opening, bool with_own) const {
  std::vector<RoundPiece> pieces;
  if (!opening.inline_for) return pieces;
  std::vector<InlineBytes> per_dest(size());
  InlineBytes first;
  bool uniform = true, seen = false;
  for (int d = 0; d < size(); ++d) {
    if (d == rank_ && !with_own) continue;
    per_dest[d] = opening.inline_for(d);
    if (!seen) first = per_dest[d];
    seen = true;
    uniform = uniform && per_dest[d] == first;
  }
  auto piece = [](int dest, InlineBytes b) { return RoundPiece{dest, b.data, b.bytes}; };
  auto sends = [](InlineBytes b) { return b.data && b.bytes > 0; };
  if (uniform) {
    if (sends(first)) pieces.push_back(piece(-1, first));
    return pieces;
  }
  for (int d = 0; d < size(); ++d) {
    if ((d != rank_ || with_own) && sends(per_dest[d])) pieces.push_back(piece(d, per_dest[d]));
  }
  return pieces;
}

Transfer TcpCommunicator::send_step(const RoundMessage& m, int step, int partner, const Opening& opening) {
  std::vector<uint8_t>& buffer = doubling_send_[step];
  const size_t bytes = encoded_size(m);
  if (bytes > doubling_recv_[step].size()) {
    throw CommError(str_cat(where(running_op()), ": a round message of ", bytes, " bytes exceeds the ",
                            doubling_recv_[step].size(), " a receiver posts (a bug: Note [Doubling round])"));
  }
  buffer.resize(bytes);
  encode(m, buffer.data());
  // Payloads count as the operation's traffic, the rest as verification.
  const int64_t payload = payload_bytes(m);
  count(OpKind::kVerify, partner, -payload, 0);
  count(static_cast<OpKind>(opening.header.kind), partner, payload, 0);
  return post_send(buffer.data(), bytes, partner, collective_slot(kHeaderSub), OpKind::kVerify);
}

// Waits for the partner's message of `step` and takes what it carries into
// `held`; a mismatch (or the partner's alarm) as the MismatchError's text.
std::string TcpCommunicator::receive_step(Transfer& in, int step, int partner, const char* op,
                                           const Opening& opening, std::vector<RoundEntry>& held) {
  const int64_t capacity = static_cast<int64_t>(in.bytes);
  try {
    wait(in);
  } catch (const MismatchError& e) {  // larger than this collective's: another collective
    return e.what();
  }
  const uint8_t* buffer = doubling_recv_[step].data();
  Header sender;
  if (decode_sender(buffer, capacity, sender) && !held[partner].known) {
    held[partner].known = true;  // what a direct round's message says; the full one replaces it below
    held[partner].header = sender;
  }
  std::string problem = known_mismatch(held, opening);
  if (!problem.empty()) return str_cat(where(op), ": ", problem);
  RoundMessage m;
  if (!decode(buffer, capacity, size(), m)) {
    return str_cat(where(op), ": ", peer_name(partner), " sent a header round this rank cannot read",
                   " (do all ranks set MESHTRAIN_GLOO_ROUND alike?)");
  }
  const int64_t payload = payload_bytes(m);
  count(OpKind::kVerify, partner, 0, static_cast<int64_t>(encoded_size(m)) - payload - capacity);
  count(static_cast<OpKind>(opening.header.kind), partner, 0, payload);
  absorb(held, m);
  problem = known_mismatch(held, opening);
  if (problem.empty() && m.alarm) {
    problem = str_cat(peer_name(partner), " found that the ranks called different collectives or passed different ",
                      "arguments (every rank must call collectives in the same order)");
  }
  return problem.empty() ? problem : str_cat(where(op), ": ", problem);
}

// The first difference among the headers this rank knows, by the rules of the final comparison.
std::string TcpCommunicator::known_mismatch(const std::vector<RoundEntry>& held, const Opening& opening) const {
  std::vector<Header> all(size());
  std::vector<bool> known(size(), false);
  for (int o = 0; o < size(); ++o) {
    if (!held[o].known) continue;
    all[o] = held[o].header;
    if (opening.ignore) opening.ignore(all[o]);
    known[o] = true;
  }
  return header_mismatch(all, opening.same_shape, global_ranks(), known);
}

// Tells every peer not yet sent to in this round (it may be waiting for this
// rank in a round of another pattern), waits until every message of this
// round has left, and raises.
void TcpCommunicator::alarm_and_raise(const std::string& what, const Opening& opening,
                                       const std::vector<RoundEntry>& held, const std::vector<bool>& sent,
                                       std::vector<Transfer>& sends) {
  RoundMessage alarm;
  alarm.sender = opening.header;
  alarm.sender.inline_bytes = 0;
  alarm.alarm = true;
  alarm.entries.resize(size());
  for (int o = 0; o < size(); ++o) {
    alarm.entries[o].known = held[o].known;
    alarm.entries[o].header = held[o].header;
  }
  alarm_buffer_.resize(encoded_size(alarm));
  encode(alarm, alarm_buffer_.data());
  for (int p = 0; p < size(); ++p) {
    if (p == rank_ || sent[p]) continue;
    sends.push_back(post_send(alarm_buffer_.data(), alarm_buffer_.size(), p, collective_slot(kHeaderSub),
                              OpKind::kVerify));
  }
  // A peer that raised first may have closed its links already: a send that
  // fails is no news (and must not wait for the failure watcher, as wait() does).
  for (Transfer& s : sends) {
    if (s.req) transport()->wait(*s.req, options_.timeout);
  }
  throw MismatchError(what);
}

Round TcpCommunicator::round_of(const std::vector<RoundEntry>& held, const Opening& opening) const {
  Round round;
  round.headers.assign(size(), Header());
  round.payload.assign(size(), nullptr);
  for (int o = 0; o < size(); ++o) {
    if (o == rank_) {
      round.headers[o] = opening.header;
      continue;
    }
    if (!held[o].known) throw CommError(str_cat(where(running_op()), ": the header round missed rank ", o));
    round.headers[o] = held[o].header;
    const RoundPiece* piece = piece_for(held[o], rank_);
    round.headers[o].inline_bytes = piece ? piece->bytes : 0;
    if (piece && piece->bytes > options_.inline_bytes) {
      throw CommError(str_cat(where(running_op()), ": malformed header round: ", piece->bytes,
                              " inline bytes from rank ", o));
    }
    if (piece && piece->bytes > 0) round.payload[o] = piece->data;
  }
  return round;
}

}  // namespace gloo_backend
}  // namespace comm
}  // namespace meshtrain
