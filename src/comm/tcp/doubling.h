#pragma once
// The doubling round: the Gloo backend's header round (Note [Header round])
// by recursive doubling on 4, 8, ... 64 ranks. Pure logic here (who talks to
// whom at each step, what a step's message carries, its wire format); the
// messages travel in TcpCommunicator::doubling_round (doubling_round.cpp).
//
// Note [Doubling round]
// The direct header round is n(n-1) messages: every rank to every peer. Where
// ranks share cores every message is a pass through the kernel's TCP and a
// wake-up, and a 4-rank round of 12 messages cost what OpenMPI's 8-message
// (Bruck) all-gather did not: forced onto a 12-message ring, OpenMPI's 4 KiB
// all-gather took the same 104-117 us as ours, 63-73 with Bruck. So on n = 2^L
// ranks (4 <= n <= 64) the round goes in L steps: at step k each rank
// exchanges one message with partner rank ^ 2^k, n L messages in all (8 on 4
// ranks, 24 on 8 where direct sends 56). Each message carries what the sender
// holds that the partner's side needs: every header it knows, and payloads.
// Rank r holds, before step k, the headers and payloads of the origins that
// differ from r only in bits below k (its group); a payload that is the same
// for every destination (all_gather, all_reduce, broadcast) is forwarded
// once per origin, a payload per destination (reduce_scatter's shards, reduce,
// gather, scatter) only towards the destinations on the partner's side of
// bit k. After the last step every rank holds every header and every origin's
// payload for itself: the same Round the direct round gives, so the
// algorithms and the comparison of headers are unchanged. Bytes: a uniform
// payload 1 + 2 + ... + n/2 = n - 1 times (as direct); a per-destination one
// n/2 per step, (n/2) L in all (4 where direct sends 3 on 4 ranks). all_reduce
// and reduce_scatter fold their payloads instead (Note [Folding round]).
//
// A mismatch must still raise everywhere, never hang. The pattern is a
// function of what the headers compare (kind, shape, dtype, root, op; Header
// rules) and n, so two ranks that run different patterns hold different
// headers. Every message begins with its sender's header, which is all a
// direct round's receiver reads (a larger doubling message fails its receive
// as too large: a MismatchError too). A rank that finds a mismatch (a header
// it received differs from its own by the comparison's rules, or an alarm)
// sends an alarm, carrying every header it knows, to each peer it has not yet
// sent to in this round, waits for its sends, and raises. Every rank of a
// direct or deferred round then hears from every peer: its doubling partners
// send to it at their step, and every other doubling rank finds the mismatch
// (the headers it gathers pass through a rank that received a direct
// message) and alarms it. Messages no receive was posted for stay behind on a
// communicator that refuses further work after a MismatchError.
//
// Note [Folding round]
// all_reduce and reduce_scatter need no origin's payload, only their sum, so
// their round reduces as it goes (recursive doubling for all_reduce, recursive
// halving for reduce_scatter, as OpenMPI's tuned collectives do): a rank holds
// partial results over its group, one per destination it still serves (or one
// for all), sends the partner those for the partner's side with every header
// it knows, and combines the partner's into its own, the lower group's first.
// Bytes per rank: all_reduce's buffer once per step, L times (4 ranks: 2, where
// forwarding sends 3; 8 ranks: 3 where it sends 7); reduce_scatter's shards
// n/2 + n/4 + ... + 1 = n - 1 (direct's volume; forwarding sent (n/2) L: 4 where
// 3 on 4 ranks, 12 where 7 on 8). The sum is the balanced tree over rank index,
// ((r0 + r1) + (r2 + r3)), the same bits on every rank (float addition
// commutes, so partners get the same result) and what comm::tree_order
// computes. Not for float16 / bfloat16, whose rank-order sum rounds once
// (reduce.h) where a fold would round at every step. Headers are compared
// before a partner's partials are combined, so a mismatch never reduces
// buffers of different sizes. On 8 ranks sharing 2 cores the fold made a
// 32 KiB all_reduce 1.4x faster (docs/comm.md).

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include <c10/core/ScalarType.h>

#include "../header.h"

namespace meshtrain {
namespace comm {
namespace gloo_backend {

// Whether a header round on n ranks goes by doubling: n = 2^L, 4 <= n <= 64.
bool doubling_applies(int n);
int doubling_steps(int n);  // L
inline int doubling_partner(int rank, int step) { return rank ^ (1 << step); }
// Whether `origin` is in `rank`'s group before `step` (differs only in bits below step).
inline bool in_group(int origin, int rank, int step) { return ((origin ^ rank) >> step) == 0; }
// Whether the payload for `dest` goes to rank's partner at `step`: dest agrees
// with rank below bit `step` and sits on the partner's side of it.
inline bool towards_partner(int dest, int rank, int step) {
  const int d = dest ^ rank;
  return (d & ((1 << step) - 1)) == 0 && ((d >> step) & 1) == 1;
}
// The most a step's message can carry when every rank's payloads fit
// `inline_bytes` each: what receives post (a larger message is a mismatch).
int64_t doubling_capacity(int n, int step, int64_t inline_bytes);

// One payload of an origin: for destination `dest`, or for every one (dest -1).
struct RoundPiece {
  int32_t dest = -1;
  const uint8_t* data = nullptr;
  int64_t bytes = 0;
};

// What a rank knows of one origin.
struct RoundEntry {
  bool known = false;
  Header header;
  std::vector<RoundPiece> pieces;
};

// One step's message. `entries` by origin rank (unknown ones are not sent).
struct RoundMessage {
  Header sender;
  bool alarm = false;  // the sender found a mismatch: `entries` are every header it knows, no payloads
  std::vector<RoundEntry> entries;
};

// What `rank` sends its partner at `step`, from what it holds (by origin).
// With `partials` (a folding round): every header it holds, no origin's
// payload, and on its own entry the partials for the partner's side.
RoundMessage step_message(const Header& mine, const std::vector<RoundEntry>& held, int rank, int step,
                          const std::vector<RoundPiece>* partials = nullptr);

// A folding round's state on one rank (Note [Folding round]): partial results
// by destination (-1: one for all), each written to into[i] once it is combined.
struct Partials {
  std::vector<RoundPiece> pieces;
  std::vector<uint8_t*> into;
  at::ScalarType dtype = at::kFloat;
  ReduceOp op = ReduceOp::kSum;
};
// Whether a round of payloads of `dtype` may fold (not float16 / bfloat16).
bool folds(at::ScalarType dtype);
// Combines the partner's partials (`theirs`: the pieces on its entry of its
// message) into those `rank` keeps after `step`, and drops the others; "" or
// what is wrong with the partner's.
std::string fold_step(Partials& mine, const std::vector<RoundPiece>& theirs, int rank, int step);
// Records a received message's entries (a piece for every destination, or
// those the receiver keeps: its own side of the step's bit).
void absorb(std::vector<RoundEntry>& held, const RoundMessage& message);
// The payload `held` has from `origin` for `dest` (nullptr: none), and its size.
const RoundPiece* piece_for(const RoundEntry& entry, int dest);

// Wire format: the sender's header, a word of flags, an entry count, then per
// entry its origin, piece count, header, and per piece its destination, size
// and bytes (each padded to 8).
size_t encoded_size(const RoundMessage& message);
void encode(const RoundMessage& message, uint8_t* out);
// Pieces point into `in` (`bytes`: the buffer's size; what follows the last
// entry is ignored). False when `in` does not hold a well-formed message for
// `n` ranks (and `out` is then unspecified).
bool decode(const uint8_t* in, size_t bytes, int n, RoundMessage& out);
// Reads only the sender's header (what a direct round's receiver reads). False when too short.
bool decode_sender(const uint8_t* in, size_t bytes, Header& out);

}  // namespace gloo_backend
}  // namespace comm
}  // namespace meshtrain
