// The doubling header round's pure logic (Note [Doubling round]): a whole
// round simulated in one process, messages encoded and decoded as on the wire.

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "comm/tcp/doubling.h"
#include "comm/header.h"

using namespace meshtrain::comm;
using namespace meshtrain::comm::gloo_backend;

namespace {

// The payload origin o sends destination d: bytes that name both (d = -1: one
// payload for every destination, naming only o). Sizes differ by origin.
std::vector<uint8_t> payload_of(int o, int d) {
  std::vector<uint8_t> bytes(8 + 3 * o + (d < 0 ? 0 : d));
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<uint8_t>(o * 31 + (d + 1) * 7 + i);
  return bytes;
}

Header header_for(int o) {
  Header h;
  h.kind = 3;
  h.numel = 100 + o;  // tells the origins apart after the round
  return h;
}

struct Simulated {
  std::vector<std::vector<RoundEntry>> held;   // [rank][origin]
  std::vector<int64_t> payload_sent;           // per rank
  int messages = 0;
  std::vector<std::vector<std::vector<uint8_t>>> wire;  // kept alive: pieces point into them
};

// Runs the round on n ranks: each rank's own entry, then every step's
// messages encoded, exchanged with the partner and absorbed.
Simulated simulate(int n, bool per_destination, std::vector<std::vector<uint8_t>>& own_payloads) {
  Simulated s;
  s.held.assign(n, std::vector<RoundEntry>(n));
  s.payload_sent.assign(n, 0);
  own_payloads.clear();
  for (int r = 0; r < n; ++r) {
    RoundEntry& e = s.held[r][r];
    e.known = true;
    e.header = header_for(r);
    for (int d = per_destination ? 0 : -1; d < (per_destination ? n : 0); ++d) {
      if (d == r) continue;
      own_payloads.push_back(payload_of(r, d));
    }
  }
  size_t next = 0;
  for (int r = 0; r < n; ++r) {
    for (int d = per_destination ? 0 : -1; d < (per_destination ? n : 0); ++d) {
      if (d == r) continue;
      const auto& p = own_payloads[next++];
      s.held[r][r].pieces.push_back({d, p.data(), static_cast<int64_t>(p.size())});
    }
  }
  const int64_t inline_bytes = 8 + 3 * n + n;  // the largest payload_of
  for (int k = 0; k < doubling_steps(n); ++k) {
    std::vector<std::vector<uint8_t>> sent(n);
    for (int r = 0; r < n; ++r) {
      const RoundMessage m = step_message(s.held[r][r].header, s.held[r], r, k);
      sent[r].resize(encoded_size(m));
      EXPECT_LE(static_cast<int64_t>(sent[r].size()), doubling_capacity(n, k, inline_bytes));
      encode(m, sent[r].data());
      for (const RoundEntry& e : m.entries)
        for (const RoundPiece& p : e.pieces) s.payload_sent[r] += p.bytes;
      ++s.messages;
    }
    for (int r = 0; r < n; ++r) {
      const auto& in = sent[doubling_partner(r, k)];
      RoundMessage m;
      EXPECT_TRUE(decode(in.data(), in.size(), n, m));
      EXPECT_EQ(m.sender.numel, header_for(doubling_partner(r, k)).numel);
      absorb(s.held[r], m);
    }
    s.wire.push_back(std::move(sent));
  }
  return s;
}

void expect_every_rank_holds_every_origins_payload_for_it(int n, bool per_destination) {
  std::vector<std::vector<uint8_t>> own;
  Simulated s = simulate(n, per_destination, own);
  EXPECT_EQ(s.messages, n * doubling_steps(n));
  for (int r = 0; r < n; ++r) {
    for (int o = 0; o < n; ++o) {
      ASSERT_TRUE(s.held[r][o].known) << "rank " << r << " origin " << o;
      EXPECT_EQ(s.held[r][o].header.numel, 100 + o);
      if (o == r) continue;
      const RoundPiece* p = piece_for(s.held[r][o], r);
      ASSERT_NE(p, nullptr) << "rank " << r << " origin " << o;
      const auto want = payload_of(o, per_destination ? r : -1);
      ASSERT_EQ(p->bytes, static_cast<int64_t>(want.size()));
      EXPECT_EQ(std::memcmp(p->data, want.data(), want.size()), 0) << "rank " << r << " origin " << o;
    }
  }
  // Bytes each rank sends: at step k its group's 2^k payloads for every
  // destination (1 + 2 + ... + n/2 = n - 1 payloads in all, as direct), or of
  // the per-destination ones those for the partner's side (n/2 per step).
  for (int r = 0; r < n; ++r) {
    int64_t want = 0, payloads = 0;
    for (int k = 0; k < doubling_steps(n); ++k) {
      for (int o = 0; o < n; ++o) {
        if (!in_group(o, r, k)) continue;
        for (int d = per_destination ? 0 : -1; d < (per_destination ? n : 0); ++d) {
          if (d == o || (d >= 0 && !towards_partner(d, r, k))) continue;
          want += payload_of(o, d).size();
          ++payloads;
        }
      }
    }
    EXPECT_EQ(s.payload_sent[r], want) << "rank " << r;
    EXPECT_EQ(payloads, per_destination ? n / 2 * doubling_steps(n) : n - 1) << "rank " << r;
  }
}

}  // namespace

TEST(DoublingRound, AppliesToPowersOfTwoFrom4To64) {
  for (int n : {1, 2, 3, 5, 6, 7, 12, 96, 128}) EXPECT_FALSE(doubling_applies(n)) << n;
  for (int n : {4, 8, 16, 32, 64}) EXPECT_TRUE(doubling_applies(n)) << n;
  EXPECT_EQ(doubling_steps(4), 2);
  EXPECT_EQ(doubling_steps(64), 6);
}

TEST(DoublingRound, EveryRankEndsWithEveryHeaderAndEveryPayloadForIt) {
  for (int n : {4, 8, 16}) {
    SCOPED_TRACE(n);
    expect_every_rank_holds_every_origins_payload_for_it(n, /*per_destination=*/false);
    expect_every_rank_holds_every_origins_payload_for_it(n, /*per_destination=*/true);
  }
}

TEST(DoublingRound, PerDestinationPayloadsGoHalfTheRanksPerStep) {
  // n/2 payloads per step and rank: on 4 ranks 4 shards in all, where the direct round sends 3.
  int sent = 0;
  for (int k = 0; k < 2; ++k)
    for (int o = 0; o < 4; ++o)
      for (int d = 0; d < 4; ++d) sent += d != o && in_group(o, 0, k) && towards_partner(d, 0, k);
  EXPECT_EQ(sent, 4);
}

TEST(DoublingRound, MalformedMessagesAreRefused) {
  Header h = header_for(1);
  RoundMessage m;
  m.sender = h;
  m.entries.resize(4);
  m.entries[2].known = true;
  m.entries[2].header = header_for(2);
  const uint8_t data[5] = {1, 2, 3, 4, 5};
  m.entries[2].pieces.push_back({3, data, 5});
  std::vector<uint8_t> wire(encoded_size(m));
  encode(m, wire.data());
  RoundMessage out;
  ASSERT_TRUE(decode(wire.data(), wire.size(), 4, out));
  ASSERT_TRUE(out.entries[2].known);
  EXPECT_EQ(std::memcmp(out.entries[2].pieces.at(0).data, data, 5), 0);
  EXPECT_FALSE(decode(wire.data(), wire.size() - 8, 4, out)) << "truncated";
  EXPECT_FALSE(decode(wire.data(), wire.size(), 2, out)) << "origin 2 on 2 ranks";
  auto corrupt = wire;
  corrupt[0] ^= 0xff;  // the sender's magic
  EXPECT_FALSE(decode(corrupt.data(), corrupt.size(), 4, out));
  // A direct round's message (a header and its payload) tells its sender and nothing more.
  std::vector<uint8_t> direct(sizeof(Header) + 64, 0xab);
  std::memcpy(direct.data(), &h, sizeof(Header));
  Header sender;
  ASSERT_TRUE(decode_sender(direct.data(), direct.size(), sender));
  EXPECT_EQ(sender.numel, h.numel);
  EXPECT_FALSE(decode(direct.data(), direct.size(), 4, out));
}

TEST(Headers, AMismatchAmongKnownHeadersSkipsTheUnknown) {
  std::vector<Header> all(4, header_for(0));
  all[0].kind = 9;  // unknown: must not count
  all[3].dtype = 7;
  EXPECT_EQ(header_mismatch(all, true, {}, {false, true, true, false}), "");
  const std::string text = header_mismatch(all, true, {}, {false, true, false, true});
  EXPECT_NE(text.find("rank 3"), std::string::npos) << text;
  EXPECT_NE(text.find("rank 1"), std::string::npos) << text;
}

namespace {

// Origin o's value for element i of destination d's part (d = -1: one part for
// all): doubles whose magnitudes differ by up to 2^40, so that another order
// of the same additions shows in the last bits.
double folding_value(int o, int d, int i) {
  return std::ldexp(1.0 + 0.1 * o + 0.01 * (d + 1) + 0.001 * i, ((o * 7 + d * 3 + i) % 41) - 20);
}

// The balanced tree's sum over origins [lo, lo + count): what a folding round
// must compute for destination d.
double tree_value(int lo, int count, int d, int i) {
  if (count == 1) return folding_value(lo, d, i);
  return tree_value(lo, count / 2, d, i) + tree_value(lo + count / 2, count / 2, d, i);
}

// A folding round on n ranks, simulated as on the wire: every rank ends with
// the tree's sum for itself (per destination: its own part; else the whole),
// having sent (n - 1) parts (per destination) or L wholes.
void expect_folding_sums_the_tree(int n, bool per_destination) {
  constexpr int kElems = 3;
  const int parts = per_destination ? n : 1;
  std::vector<std::vector<double>> own(n), out(n);
  std::vector<Partials> partials(n);
  std::vector<std::vector<RoundEntry>> held(n, std::vector<RoundEntry>(n));
  for (int r = 0; r < n; ++r) {
    own[r].resize(parts * kElems);
    out[r].resize(parts * kElems);
    held[r][r].known = true;
    held[r][r].header = header_for(r);
    partials[r].dtype = at::kDouble;
    for (int p = 0; p < parts; ++p) {
      const int d = per_destination ? p : -1;
      for (int i = 0; i < kElems; ++i) own[r][p * kElems + i] = folding_value(r, d, i);
      partials[r].pieces.push_back({d, reinterpret_cast<const uint8_t*>(&own[r][p * kElems]), kElems * 8});
      partials[r].into.push_back(reinterpret_cast<uint8_t*>(&out[r][p * kElems]));
    }
  }
  std::vector<int64_t> sent_bytes(n, 0);
  for (int k = 0; k < doubling_steps(n); ++k) {
    std::vector<std::vector<uint8_t>> wire(n);
    for (int r = 0; r < n; ++r) {
      const RoundMessage m = step_message(held[r][r].header, held[r], r, k, &partials[r].pieces);
      wire[r].resize(encoded_size(m));
      ASSERT_LE(static_cast<int64_t>(wire[r].size()), doubling_capacity(n, k, kElems * 8));
      encode(m, wire[r].data());
      for (const RoundEntry& e : m.entries)
        for (const RoundPiece& p : e.pieces) sent_bytes[r] += p.bytes;
    }
    for (int r = 0; r < n; ++r) {
      const int partner = doubling_partner(r, k);
      RoundMessage m;
      ASSERT_TRUE(decode(wire[partner].data(), wire[partner].size(), n, m));
      absorb(held[r], m);
      ASSERT_EQ(fold_step(partials[r], held[r][partner].pieces, r, k), "") << "rank " << r << " step " << k;
    }
  }
  for (int r = 0; r < n; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    for (int o = 0; o < n; ++o) EXPECT_EQ(held[r][o].header.numel, 100 + o);  // every header, as forwarding
    ASSERT_EQ(partials[r].pieces.size(), 1u);
    EXPECT_EQ(partials[r].pieces[0].dest, per_destination ? r : -1);
    const auto* got = reinterpret_cast<const double*>(partials[r].pieces[0].data);
    for (int i = 0; i < kElems; ++i) {
      const double want = tree_value(0, n, per_destination ? r : -1, i);
      EXPECT_EQ(std::memcmp(&got[i], &want, 8), 0) << "element " << i << ": " << got[i] << " vs " << want;
    }
    EXPECT_EQ(sent_bytes[r], kElems * 8 * (per_destination ? n - 1 : doubling_steps(n)));
  }
}

}  // namespace

TEST(DoublingRound, FoldingSumsTheBalancedTreeInFewerBytes) {
  for (int n : {4, 8, 16}) {
    SCOPED_TRACE(n);
    expect_folding_sums_the_tree(n, /*per_destination=*/false);
    expect_folding_sums_the_tree(n, /*per_destination=*/true);
  }
  // The rank-order sum differs from the tree's in the last bits for these values (so the test can tell them apart).
  double rank_order = 0;
  for (int o = 0; o < 8; ++o) rank_order += folding_value(o, -1, 0);
  EXPECT_NE(rank_order, tree_value(0, 8, -1, 0));
}

TEST(DoublingRound, AFoldRefusesPartialsOfAnotherSize) {
  Partials mine;
  mine.dtype = at::kFloat;
  float a[4] = {1, 2, 3, 4}, b[3] = {1, 1, 1}, out[4];
  mine.pieces.push_back({-1, reinterpret_cast<const uint8_t*>(a), 16});
  mine.into.push_back(reinterpret_cast<uint8_t*>(out));
  EXPECT_NE(fold_step(mine, {{-1, reinterpret_cast<const uint8_t*>(b), 12}}, 0, 0), "");
  EXPECT_NE(fold_step(mine, {}, 0, 0), "");
  EXPECT_EQ(fold_step(mine, {{-1, reinterpret_cast<const uint8_t*>(a), 16}}, 0, 0), "");
  EXPECT_EQ(out[3], 8.0f);
}
