// The doubling round's pure logic: Note [Doubling round] in doubling.h.

#include "doubling.h"

#include <algorithm>
#include <cstring>

#include "../reduce.h"

namespace meshtrain {
namespace comm {
namespace gloo_backend {

namespace {

constexpr size_t kWord = 8;
constexpr size_t kPrefix = sizeof(Header) + 2 * sizeof(int32_t);      // sender, flags, entry count
constexpr size_t kEntryHead = 2 * sizeof(int32_t) + sizeof(Header);    // origin, piece count, header
constexpr size_t kPieceHead = 2 * sizeof(int32_t) + sizeof(int64_t);   // dest, padding, bytes
static_assert(sizeof(Header) % kWord == 0, "entries stay 8-byte aligned");

size_t padded(int64_t bytes) { return (static_cast<size_t>(bytes) + kWord - 1) / kWord * kWord; }

// Appends to a buffer the caller sized with encoded_size().
struct Writer {
  uint8_t* at;
  void put(const void* src, size_t bytes) {
    if (bytes > 0) std::memcpy(at, src, bytes);
    at += bytes;
  }
  void i32(int32_t v) { put(&v, sizeof(v)); }
  void i64(int64_t v) { put(&v, sizeof(v)); }
  void pad_to(size_t bytes, size_t written) {
    std::memset(at, 0, bytes - written);
    at += bytes - written;
  }
};

// Reads with bounds checks; `ok` turns false at the first read past the end.
struct Reader {
  const uint8_t* at;
  const uint8_t* end;
  bool ok = true;
  bool take(void* dst, size_t bytes) {
    if (!ok || static_cast<size_t>(end - at) < bytes) return ok = false;
    std::memcpy(dst, at, bytes);
    at += bytes;
    return true;
  }
  const uint8_t* skip(size_t bytes) {
    if (!ok || static_cast<size_t>(end - at) < bytes) {
      ok = false;
      return nullptr;
    }
    const uint8_t* p = at;
    at += bytes;
    return p;
  }
};

bool well_formed(const Header& h) { return h.magic == Header().magic; }

}  // namespace

bool doubling_applies(int n) { return n >= 4 && n <= 64 && (n & (n - 1)) == 0; }

int doubling_steps(int n) {
  int steps = 0;
  while ((1 << steps) < n) ++steps;
  return steps;
}

int64_t doubling_capacity(int n, int step, int64_t inline_bytes) {
  const int64_t origins = int64_t{1} << step;
  // Uniform payloads: one per origin; per-destination ones: n/2 per step.
  const int64_t pieces = std::max<int64_t>(origins, n / 2);
  return static_cast<int64_t>(kPrefix + origins * kEntryHead) + pieces * static_cast<int64_t>(kPieceHead + padded(inline_bytes));
}

RoundMessage step_message(const Header& mine, const std::vector<RoundEntry>& held, int rank, int step,
                          const std::vector<RoundPiece>* partials) {
  RoundMessage m;
  m.sender = mine;
  m.sender.inline_bytes = 0;
  m.entries.resize(held.size());
  for (size_t o = 0; o < held.size(); ++o) {
    if (!held[o].known) continue;
    RoundEntry& e = m.entries[o];
    e.known = true;
    e.header = held[o].header;
    if (partials && static_cast<int>(o) != rank) continue;  // a folding round's payloads ride on the sender's entry
    for (const RoundPiece& p : partials ? *partials : held[o].pieces) {
      if (p.dest < 0 || towards_partner(p.dest, rank, step)) e.pieces.push_back(p);
    }
  }
  return m;
}

bool folds(at::ScalarType dtype) { return dtype != at::kHalf && dtype != at::kBFloat16; }

std::string fold_step(Partials& mine, const std::vector<RoundPiece>& theirs, int rank, int step) {
  const bool mine_first = ((rank >> step) & 1) == 0;  // this rank's group is the lower one
  const int64_t elem = static_cast<int64_t>(c10::elementSize(mine.dtype));
  size_t kept = 0;
  for (size_t i = 0; i < mine.pieces.size(); ++i) {
    RoundPiece p = mine.pieces[i];
    if (p.dest >= 0 && towards_partner(p.dest, rank, step)) continue;  // the partner's side: sent, not kept
    const RoundPiece* other = nullptr;
    for (const RoundPiece& t : theirs) {
      if (t.dest == p.dest) other = &t;
    }
    if (!other || other->bytes != p.bytes) return "a partial result of another size than this rank's";
    reduce_into(mine.into[i], mine_first ? p.data : other->data, mine_first ? other->data : p.data, p.bytes / elem,
                mine.dtype, mine.op);
    p.data = mine.into[i];
    mine.pieces[kept] = p;
    mine.into[kept++] = mine.into[i];
  }
  if (kept != theirs.size()) return "partial results for destinations this rank does not serve";
  mine.pieces.resize(kept);
  mine.into.resize(kept);
  return "";
}

void absorb(std::vector<RoundEntry>& held, const RoundMessage& message) {
  for (size_t o = 0; o < message.entries.size() && o < held.size(); ++o) {
    if (message.entries[o].known) held[o] = message.entries[o];
  }
}

const RoundPiece* piece_for(const RoundEntry& entry, int dest) {
  for (const RoundPiece& p : entry.pieces) {
    if (p.dest == dest || p.dest < 0) return &p;
  }
  return nullptr;
}

size_t encoded_size(const RoundMessage& message) {
  size_t bytes = kPrefix;
  for (const RoundEntry& e : message.entries) {
    if (!e.known) continue;
    bytes += kEntryHead;
    for (const RoundPiece& p : e.pieces) bytes += kPieceHead + padded(p.bytes);
  }
  return bytes;
}

void encode(const RoundMessage& message, uint8_t* out) {
  Writer w{out};
  w.put(&message.sender, sizeof(Header));
  w.i32(message.alarm ? 1 : 0);
  int32_t count = 0;
  for (const RoundEntry& e : message.entries) count += e.known ? 1 : 0;
  w.i32(count);
  for (size_t o = 0; o < message.entries.size(); ++o) {
    const RoundEntry& e = message.entries[o];
    if (!e.known) continue;
    w.i32(static_cast<int32_t>(o));
    w.i32(static_cast<int32_t>(e.pieces.size()));
    w.put(&e.header, sizeof(Header));
    for (const RoundPiece& p : e.pieces) {
      w.i32(p.dest);
      w.i32(0);
      w.i64(p.bytes);
      w.put(p.data, static_cast<size_t>(p.bytes));
      w.pad_to(padded(p.bytes), static_cast<size_t>(p.bytes));
    }
  }
}

bool decode_sender(const uint8_t* in, size_t bytes, Header& out) {
  Reader r{in, in + bytes};
  return r.take(&out, sizeof(Header)) && well_formed(out);
}

bool decode(const uint8_t* in, size_t bytes, int n, RoundMessage& out) {
  Reader r{in, in + bytes};
  int32_t alarm = 0, count = 0;
  if (!r.take(&out.sender, sizeof(Header)) || !r.take(&alarm, 4) || !r.take(&count, 4)) return false;
  if (!well_formed(out.sender) || count < 0 || count > n) return false;
  out.alarm = alarm != 0;
  out.entries.assign(n, RoundEntry());
  for (int32_t i = 0; i < count; ++i) {
    int32_t origin = -1, pieces = -1;
    if (!r.take(&origin, 4) || !r.take(&pieces, 4)) return false;
    if (origin < 0 || origin >= n || pieces < 0 || pieces > n || out.entries[origin].known) return false;
    RoundEntry& e = out.entries[origin];
    if (!r.take(&e.header, sizeof(Header)) || !well_formed(e.header)) return false;
    e.known = true;
    e.pieces.resize(pieces);
    for (RoundPiece& p : e.pieces) {
      int32_t pad = 0;
      if (!r.take(&p.dest, 4) || !r.take(&pad, 4) || !r.take(&p.bytes, 8)) return false;
      if (p.dest < -1 || p.dest >= n || p.bytes < 0 || p.bytes > static_cast<int64_t>(bytes)) return false;
      p.data = r.skip(padded(p.bytes));
      if (!p.data) return false;
    }
  }
  return r.ok;  // what follows the last entry is stale bytes of a larger buffer
}

}  // namespace gloo_backend
}  // namespace comm
}  // namespace meshtrain
