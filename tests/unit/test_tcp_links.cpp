// tcp::Links (the Gloo backend's default transport) between threads of one
// process over 127.0.0.1: matching by peer and slot whatever the order of
// sends and receives, large messages both ways at once, and each way a wait
// ends without its message (closed peer, timeout, abort, a buffer too small).

#include <gtest/gtest.h>

#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>
#include <algorithm>
#include <numeric>
#include <thread>

#include "comm/tcp/links.h"

using namespace meshtrain::comm;
using namespace std::chrono_literals;

namespace {

// The store the ranks meet in, in memory.
class MemoryStore : public Store {
 public:
  void set(const std::string& key, const std::string& value) override {
    std::lock_guard<std::mutex> lock(mutex_);
    values_[key] = value;
    changed_.notify_all();
  }
  std::string get(const std::string& key) override {
    std::unique_lock<std::mutex> lock(mutex_);
    changed_.wait(lock, [&] { return values_.count(key) > 0; });
    return values_[key];
  }
  int64_t add(const std::string&, int64_t) override { return 0; }
  bool check(const std::string& key) override {
    std::lock_guard<std::mutex> lock(mutex_);
    return values_.count(key) > 0;
  }
  void wait(const std::vector<std::string>& keys) override {
    for (const auto& k : keys) get(k);
  }
  std::chrono::milliseconds timeout() const override { return 10s; }

 private:
  std::mutex mutex_;
  std::condition_variable changed_;
  std::map<std::string, std::string> values_;
};

// `size` ranks' links, connected by threads (each constructor waits for the others).
std::vector<std::unique_ptr<tcp::Links>> connect(int size, std::chrono::milliseconds timeout = 10s) {
  MemoryStore store;
  std::vector<std::unique_ptr<tcp::Links>> links(size);
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r) {
    threads.emplace_back([&, r] { links[r] = std::make_unique<tcp::Links>(store, r, size, "127.0.0.1", timeout, "test"); });
  }
  for (auto& t : threads) t.join();
  return links;
}

std::vector<int32_t> iota_from(int32_t start, size_t n) {
  std::vector<int32_t> v(n);
  std::iota(v.begin(), v.end(), start);
  return v;
}

}  // namespace

TEST(TcpLinks, MessagesMatchByPeerAndSlotWhicheverComesFirst) {
  auto links = connect(3);
  const auto a = iota_from(0, 100), b = iota_from(1000, 7), c = iota_from(-50, 3);
  // Rank 1 sends slot 5 twice and slot 9 once before rank 0 posts anything,
  // rank 2 a zero-byte message on slot 5.
  auto s1 = links[1]->send(0, 5, a.data(), a.size() * 4);
  auto s2 = links[1]->send(0, 9, b.data(), b.size() * 4);
  auto s3 = links[1]->send(0, 5, c.data(), c.size() * 4);
  auto s4 = links[2]->send(0, 5, nullptr, 0);
  std::vector<int32_t> got9(7), got5a(100), got5b(3), big(200);
  auto r9 = links[0]->recv(1, 9, got9.data(), got9.size() * 4);
  auto r5a = links[0]->recv(1, 5, got5a.data(), got5a.size() * 4);
  auto r2 = links[0]->recv(2, 5, big.data(), big.size() * 4);  // a larger buffer takes a smaller message
  auto r5b = links[0]->recv(1, 5, got5b.data(), got5b.size() * 4);
  for (auto* r : {r9.get(), r5a.get(), r2.get(), r5b.get()}) EXPECT_EQ(links[0]->wait(*r, 5s), WaitResult::kDone);
  for (auto* s : {s1.get(), s2.get(), s3.get()}) EXPECT_EQ(links[1]->wait(*s, 5s), WaitResult::kDone);
  EXPECT_EQ(links[2]->wait(*s4, 5s), WaitResult::kDone);
  EXPECT_EQ(got9, b);
  EXPECT_EQ(got5a, a);  // the first message of slot 5 to the first receive of slot 5
  EXPECT_EQ(got5b, c);
  EXPECT_EQ(r2->received, 0u);
  EXPECT_EQ(r5a->received, 400u);
}

// A held send (a collective's header, Note [Verification beside the data])
// waits in the queue, then leaves with the next send to its peer, in order, or
// when its sender waits.
TEST(TcpLinks, HeldSendsLeaveWithTheNextSendOrWhenTheSenderWaits) {
  auto links = connect(2);
  const auto a = iota_from(0, 10), b = iota_from(100, 5000), c = iota_from(-7, 3);
  std::vector<int32_t> got_a(10), got_b(5000), got_c(3);
  auto held = links[0]->send(1, 4, a.data(), a.size() * 4, /*hold=*/true);
  auto ra = links[1]->recv(0, 4, got_a.data(), got_a.size() * 4);
  EXPECT_EQ(links[1]->wait(*ra, 200ms), WaitResult::kTimeout);  // nothing left rank 0
  EXPECT_FALSE(held->done);
  auto next = links[0]->send(1, 8, b.data(), b.size() * 4);
  EXPECT_TRUE(held->done);  // both fit the socket: written by the send call itself
  EXPECT_TRUE(next->done);
  auto rb = links[1]->recv(0, 8, got_b.data(), got_b.size() * 4);
  EXPECT_EQ(links[1]->wait(*ra, 5s), WaitResult::kDone);
  EXPECT_EQ(links[1]->wait(*rb, 5s), WaitResult::kDone);
  EXPECT_EQ(got_a, a);
  EXPECT_EQ(got_b, b);

  auto alone = links[0]->send(1, 2, c.data(), c.size() * 4, /*hold=*/true);
  auto rc = links[1]->recv(0, 2, got_c.data(), got_c.size() * 4);
  EXPECT_EQ(links[0]->wait(*alone, 5s), WaitResult::kDone);
  EXPECT_EQ(links[1]->wait(*rc, 5s), WaitResult::kDone);
  EXPECT_EQ(got_c, c);
}

TEST(TcpLinks, LargeMessagesBothWaysAtOnceWhileReceivesArePostedLate) {
  auto links = connect(2);
  const size_t n = 6 << 20;  // 24 MiB each way: far beyond the sockets' buffers
  const auto out0 = iota_from(0, n), out1 = iota_from(7, n);
  std::vector<int32_t> in0(n), in1(n);
  auto run = [&](int r, const std::vector<int32_t>& out, std::vector<int32_t>& in) {
    auto s = links[r]->send(1 - r, 3, out.data(), n * 4);
    std::this_thread::sleep_for(std::chrono::milliseconds(20 * r));  // rank 1 posts its receive late
    auto rc = links[r]->recv(1 - r, 3, in.data(), n * 4);
    EXPECT_EQ(links[r]->wait(*rc, 20s), WaitResult::kDone);
    EXPECT_EQ(links[r]->wait(*s, 20s), WaitResult::kDone);
  };
  std::thread t0(run, 0, std::cref(out0), std::ref(in0)), t1(run, 1, std::cref(out1), std::ref(in1));
  t0.join();
  t1.join();
  EXPECT_EQ(in0, out1);
  EXPECT_EQ(in1, out0);
}

// Note [Large messages wait in the socket]: a large message found behind the
// one a rank waited for stays in the socket until its receive is posted, then
// lands in that buffer, copied once, however much of it was read with the
// message before it.
TEST(TcpLinks, ALargeMessageAheadOfItsReceiveWaitsInTheSocket) {
  auto links = connect(2);
  const size_t n = 1 << 20;  // 4 MiB: many reads
  const auto first = iota_from(7, 16), large = iota_from(-3, n);
  auto s_first = links[0]->send(1, 1, first.data(), first.size() * 4);
  auto s_large = links[0]->send(1, 2, large.data(), n * 4);  // right behind it in the stream
  std::vector<int32_t> got_first(16), got_large(n);
  std::this_thread::sleep_for(20ms);  // both are in the socket: the first read takes the large one's header too
  auto r_first = links[1]->recv(0, 1, got_first.data(), got_first.size() * 4);
  ASSERT_EQ(links[1]->wait(*r_first, 5s), WaitResult::kDone);
  EXPECT_EQ(got_first, first);
  EXPECT_EQ(links[1]->early_bytes(), 0u);  // the large one was not read ahead
  auto r_large = links[1]->recv(0, 2, got_large.data(), n * 4);
  std::thread sender([&] { EXPECT_EQ(links[0]->wait(*s_large, 10s), WaitResult::kDone); });
  EXPECT_EQ(links[1]->wait(*r_large, 10s), WaitResult::kDone);
  sender.join();
  EXPECT_EQ(got_large, large);
  EXPECT_EQ(links[1]->early_bytes(), 0u);
  (void)s_first;
}

// What a held message must never do: stop a wait that needs it read. Each
// rank waits for its own large send to finish before it posts the receive
// for its peer's: it finishes only if the peer reads ahead, which a waiter
// does before it sleeps.
TEST(TcpLinks, AHeldMessageIsReadAheadWhenAWaitDependsOnIt) {
  auto links = connect(2);
  for (auto& l : links) l->set_local_buffer(256 << 10);  // sends of 16 MiB cannot finish unread
  const size_t n = 4 << 20;  // 16 MiB each way
  const auto out0 = iota_from(0, n), out1 = iota_from(9, n);
  std::vector<int32_t> in0(n), in1(n);
  auto run = [&](int r, const std::vector<int32_t>& out, std::vector<int32_t>& in) {
    auto s = links[r]->send(1 - r, 3, out.data(), n * 4);
    EXPECT_EQ(links[r]->wait(*s, 20s), WaitResult::kDone);
    auto rc = links[r]->recv(1 - r, 3, in.data(), n * 4);
    EXPECT_EQ(links[r]->wait(*rc, 20s), WaitResult::kDone);
  };
  std::thread t0(run, 0, std::cref(out0), std::ref(in0)), t1(run, 1, std::cref(out1), std::ref(in1));
  t0.join();
  t1.join();
  EXPECT_EQ(in0, out1);
  EXPECT_EQ(in1, out0);
  EXPECT_GT(links[0]->early_bytes() + links[1]->early_bytes(), 0u);  // read ahead, by one rank at least
}

// A receive posted for a message behind a held one needs the held one read
// out of the way: posting it reads the held one into a spare buffer at once.
TEST(TcpLinks, AReceiveBehindAHeldMessageReadsItAhead) {
  auto links = connect(3);
  const size_t n = 1 << 20;  // 4 MiB
  const auto large = iota_from(1, n), small = iota_from(-5, 4), other = iota_from(3, 2);
  auto s_large = links[0]->send(1, 5, large.data(), n * 4);
  auto s_small = links[0]->send(1, 6, small.data(), 16);
  auto s_other = links[2]->send(1, 1, other.data(), 8);
  std::this_thread::sleep_for(20ms);  // all in the sockets
  // Rank 1 waits for rank 2's message and reads rank 0's stream meanwhile:
  // slot 5's header, no receive posted on rank 0: held.
  std::vector<int32_t> got_other(2), got_small(4), got_large(n);
  auto r_other = links[1]->recv(2, 1, got_other.data(), 8);
  ASSERT_EQ(links[1]->wait(*r_other, 5s), WaitResult::kDone);
  EXPECT_EQ(got_other, other);
  EXPECT_EQ(links[1]->early_bytes(), 0u);
  auto r_small = links[1]->recv(0, 6, got_small.data(), 16);
  EXPECT_EQ(links[1]->early_bytes(), n * 4);  // slot 5's message goes to a spare buffer now
  std::thread sender([&] { EXPECT_EQ(links[0]->wait(*s_small, 20s), WaitResult::kDone); });
  EXPECT_EQ(links[1]->wait(*r_small, 20s), WaitResult::kDone);
  sender.join();
  auto r_large = links[1]->recv(0, 5, got_large.data(), n * 4);
  EXPECT_EQ(links[1]->wait(*r_large, 5s), WaitResult::kDone);
  EXPECT_EQ(got_small, small);
  EXPECT_EQ(got_large, large);
  (void)s_large;
  (void)s_other;
}

// Note [Link buffers sized to the cache]: every link over 127.0.0.1 stays on
// this host, so each is bounded, and large messages still pass whole.
TEST(TcpLinks, LinksOnThisHostAreBoundedAndStillCarryLargeMessages) {
  auto links = connect(3);
  for (auto& l : links) EXPECT_EQ(l->set_local_buffer(256 << 10), 2);
  EXPECT_EQ(links[0]->set_local_buffer(0), 0);  // 0: the kernel's autotuning, nothing set
  const size_t n = 3 << 20;  // 12 MiB to the next rank: 48 times what a link holds
  std::vector<std::vector<int32_t>> out, in(3, std::vector<int32_t>(n));
  for (int r = 0; r < 3; ++r) out.push_back(iota_from(100 * r, n));
  std::vector<std::thread> ranks;
  for (int r = 0; r < 3; ++r) {
    ranks.emplace_back([&, r] {
      auto s = links[r]->send((r + 1) % 3, 4, out[r].data(), n * 4);
      auto rc = links[r]->recv((r + 2) % 3, 4, in[r].data(), n * 4);
      EXPECT_EQ(links[r]->wait(*rc, 20s), WaitResult::kDone);
      EXPECT_EQ(links[r]->wait(*s, 20s), WaitResult::kDone);
    });
  }
  for (auto& t : ranks) t.join();
  for (int r = 0; r < 3; ++r) EXPECT_EQ(in[r], out[(r + 2) % 3]) << "rank " << r;
}

TEST(TcpLinks, TwoThreadsWaitingOnOneRankBothComplete) {
  auto links = connect(2);
  const auto a = iota_from(1, 1000), b = iota_from(2, 1000);
  std::vector<int32_t> ga(1000), gb(1000);
  auto ra = links[0]->recv(1, 1, ga.data(), 4000);
  auto rb = links[0]->recv(1, 2, gb.data(), 4000);
  std::thread waiter([&] { EXPECT_EQ(links[0]->wait(*rb, 5s), WaitResult::kDone); });
  std::thread sender([&] {
    std::this_thread::sleep_for(20ms);
    auto s1 = links[1]->send(0, 2, b.data(), 4000);
    auto s2 = links[1]->send(0, 1, a.data(), 4000);
    EXPECT_EQ(links[1]->wait(*s1, 5s), WaitResult::kDone);
    EXPECT_EQ(links[1]->wait(*s2, 5s), WaitResult::kDone);
  });
  EXPECT_EQ(links[0]->wait(*ra, 5s), WaitResult::kDone);
  waiter.join();
  sender.join();
  EXPECT_EQ(ga, a);
  EXPECT_EQ(gb, b);
}

TEST(TcpLinks, AWaitEndsWithoutItsMessageOnTimeoutAbortClosedPeerOrSmallBuffer) {
  auto links = connect(3);
  int32_t x = 0;
  auto r = links[0]->recv(1, 1, &x, 4);
  const auto start = std::chrono::steady_clock::now();
  EXPECT_EQ(links[0]->wait(*r, 200ms), WaitResult::kTimeout);
  EXPECT_GE(std::chrono::steady_clock::now() - start, 200ms);

  std::thread aborter([&] {
    std::this_thread::sleep_for(50ms);
    links[0]->abort();
  });
  EXPECT_EQ(links[0]->wait(*r, 10s), WaitResult::kAborted);
  aborter.join();

  // A message larger than its receive fails that receive alone: it is read
  // past, and the link carries the next message whole (large ones too).
  const std::vector<int32_t> eight = iota_from(0, 8), big = iota_from(5, 1 << 20);
  auto s = links[2]->send(1, 4, eight.data(), 32);
  auto s_big = links[2]->send(1, 4, big.data(), big.size() * 4);
  auto after = links[2]->send(1, 4, eight.data(), 32);
  std::thread sender([&] {  // a send beyond the socket's buffer progresses while its rank waits
    EXPECT_EQ(links[2]->wait(*s_big, 5s), WaitResult::kDone);
    EXPECT_EQ(links[2]->wait(*after, 5s), WaitResult::kDone);
  });
  auto small = links[1]->recv(2, 4, &x, 4);
  EXPECT_EQ(links[1]->wait(*small, 5s), WaitResult::kTooLarge);
  EXPECT_EQ(small->received, 32u);  // what the message carried
  std::vector<int32_t> half(big.size() / 2), whole(8);
  auto r_big = links[1]->recv(2, 4, half.data(), half.size() * 4);
  EXPECT_EQ(links[1]->wait(*r_big, 5s), WaitResult::kTooLarge);
  auto r_after = links[1]->recv(2, 4, whole.data(), whole.size() * 4);
  EXPECT_EQ(links[1]->wait(*r_after, 5s), WaitResult::kDone);
  EXPECT_EQ(whole, eight);
  EXPECT_EQ(links[1]->broken_reason(2), "");
  sender.join();

  auto from2 = links[1]->recv(0, 2, &x, 4);
  links[0].reset();  // rank 0 goes away
  EXPECT_EQ(links[1]->wait(*from2, 5s), WaitResult::kBroken);
  EXPECT_EQ(links[1]->broken_reason(0), "the peer closed the connection");
}

// A peer that sent its last message and closed: sends to it fail, naming why,
// and its last message is still read (Note [Verification beside the data]:
// the header that says why a peer stopped arrives before its connection ends).
TEST(TcpLinks, WhatAPeerSentBeforeItClosedIsStillRead) {
  auto links = connect(2);
  const std::vector<int32_t> last = iota_from(40, 8), big = iota_from(0, 4 << 20);
  auto s_last = links[0]->send(1, 6, last.data(), 32);
  EXPECT_EQ(links[0]->wait(*s_last, 5s), WaitResult::kDone);
  auto s_big = links[1]->send(0, 6, big.data(), big.size() * 4);  // more than rank 0 will read
  links[0].reset();
  EXPECT_EQ(links[1]->wait(*s_big, 5s), WaitResult::kBroken);
  EXPECT_FALSE(links[1]->broken_reason(0).empty());
  std::vector<int32_t> got(8);
  auto r = links[1]->recv(0, 6, got.data(), 32);
  EXPECT_EQ(links[1]->wait(*r, 5s), WaitResult::kDone);
  EXPECT_EQ(got, last);
}

TEST(TcpLinks, ALinkToItselfOrOutOfRangeIsRefusedNamingTheRank) {
  auto links = connect(2);
  int32_t x = 0;
  for (int peer : {0, 2, -1}) {
    try {
      links[0]->send(peer, 1, &x, 4);
      ADD_FAILURE() << "no error for peer " << peer;
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find("no link to rank " + std::to_string(peer)), std::string::npos) << e.what();
    }
  }
}

// Error paths free buffers without waiting for their requests: a dropped
// request is withdrawn, and the stream stays whole for the messages after it.
TEST(TcpLinks, DroppedRequestsAreWithdrawnAndTheStreamStaysWhole) {
  auto links = connect(2);
  const size_t n = 6 << 20;  // 24 MiB: more than the sockets hold
  // A receive dropped before its message: the message goes to the next receive of its slot.
  {
    std::vector<int32_t> dropped(4);
    Posted withdrawn(links[0].get(), links[0]->recv(1, 7, dropped.data(), 16));
  }
  const auto four = iota_from(40, 4);
  auto s = links[1]->send(0, 7, four.data(), 16);
  std::vector<int32_t> got(4);
  auto r = links[0]->recv(1, 7, got.data(), 16);
  ASSERT_EQ(links[0]->wait(*r, 5s), WaitResult::kDone);
  EXPECT_EQ(got, four);

  // A send dropped half-written: the peer still gets the whole payload as it was posted.
  auto big = std::make_unique<std::vector<int32_t>>(iota_from(3, n));
  {
    Posted half(links[1].get(), links[1]->send(0, 8, big->data(), n * 4));
    EXPECT_FALSE(half.get()->done);  // the socket took only part of it
  }
  std::fill(big->begin(), big->end(), -1);
  big.reset();
  // A receive dropped while its message arrives: the rest is read and dropped.
  std::vector<int32_t> into(n);
  {
    Posted arriving(links[0].get(), links[0]->recv(1, 8, into.data(), n * 4));
    EXPECT_EQ(links[0]->wait(*arriving, std::chrono::milliseconds(1)), WaitResult::kTimeout);
  }
  std::fill(into.begin(), into.end(), 0);
  // The messages after them arrive intact.
  const auto after = iota_from(-9, 5);
  auto s2 = links[1]->send(0, 9, after.data(), 20);
  std::vector<int32_t> got2(5);
  auto r2 = links[0]->recv(1, 9, got2.data(), 20);
  std::thread rest([&] {  // the sender writes the rest of the dropped send, then this one
    EXPECT_EQ(links[1]->wait(*s2, 10s), WaitResult::kDone) << links[1]->broken_reason(0);
  });
  EXPECT_EQ(links[0]->wait(*r2, 10s), WaitResult::kDone) << links[0]->broken_reason(1);
  rest.join();
  EXPECT_EQ(got2, after);
  EXPECT_TRUE(std::all_of(into.begin(), into.end(), [](int32_t v) { return v == 0; }));  // nothing written after the drop
  // And a large message after them arrives whole (the communicator never
  // reuses a slot: a withdrawn receive's message that had not begun to arrive
  // is kept for its slot, as any early message).
  auto again = iota_from(5, n);
  auto s3 = links[1]->send(0, 10, again.data(), n * 4);
  std::vector<int32_t> got3(n);
  auto r3 = links[0]->recv(1, 10, got3.data(), n * 4);
  std::thread sender([&] { EXPECT_EQ(links[1]->wait(*s3, 20s), WaitResult::kDone); });
  EXPECT_EQ(links[0]->wait(*r3, 20s), WaitResult::kDone);
  sender.join();
  EXPECT_EQ(got3, again);
  (void)s;
}

// A receiver busy for longer than the store's link timeout (MESHTRAIN_LINK_TIMEOUT_S,
// 8 s; here 2 s) while an eager send waits behind its full window: the link holds.
TEST(TcpLinks, ASendWaitingOnABusyReceiverOutlastsTheLinkTimeout) {
  setenv("MESHTRAIN_LINK_TIMEOUT_S", "2", 1);
  auto links = connect(2);
  unsetenv("MESHTRAIN_LINK_TIMEOUT_S");
  const size_t n = 8 << 20;  // 32 MiB: the rest waits on a zero window
  const auto out = iota_from(1, n);
  auto s = links[1]->send(0, 1, out.data(), n * 4);
  EXPECT_EQ(links[1]->wait(*s, std::chrono::milliseconds(4000)), WaitResult::kTimeout);  // nobody reads
  std::vector<int32_t> in(n);
  auto r = links[0]->recv(1, 1, in.data(), n * 4);
  std::thread sender([&] { EXPECT_EQ(links[1]->wait(*s, 20s), WaitResult::kDone) << links[1]->broken_reason(0); });
  EXPECT_EQ(links[0]->wait(*r, 20s), WaitResult::kDone) << links[0]->broken_reason(1);
  sender.join();
  EXPECT_EQ(in, out);
}
