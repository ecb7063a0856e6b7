#pragma once
// tcp::Links: one TCP connection to every peer of a communicator, carrying
// messages addressed by (peer, slot), progressed by the thread that waits.
//
// Note [Links: progress on the waiting thread]
// libgloo's TCP transport runs every socket from an event-loop thread and
// sends a message only after the receiver announced its buffer (a rendezvous:
// "recv ready", then the data, written by the loop thread when the notice
// arrives). A small exchange between two ranks then costs three to four thread
// hand-offs per rank and two extra messages (a 4 KiB all-reduce: ~12 system
// calls per rank where the kernel needs 2), and on a 2-core host with four
// such threads per pair of ranks the waits that miss a core wait for the
// scheduler's tick: 4 to 12 ms tails, measured. OpenMPI's TCP transport instead
// progresses its sockets on the calling thread.
//
// Links do the same. A send is written at once, from the poster's thread,
// header and payload in one writev (eager: the receiver need not have posted
// its buffer); what the socket does not take is written while someone waits.
// A waiting thread reads every connection: a message whose (peer, slot) has a
// posted receive goes straight into that buffer (large payloads are read from
// the socket into it directly), any other is kept until its receive is posted
// (messages of one peer and slot match in order, as in gloo); a large one
// stays in the socket meanwhile (Note [Large messages wait in the socket] in
// links_read.cpp). With nothing to
// do it blocks in poll() on every connection, so a message wakes the waiting
// thread itself: one wake-up, no hand-off, no thread of our own. One thread
// polls at a time; others wait for its rounds. An abort (the failure watcher)
// wakes the poller through an eventfd. Where every rank of the host has a core
// of its own, the waiting thread first reads without blocking for a few
// microseconds (set_waits), as the shared-memory backend spins: a reply that
// comes within them costs no sleep and no wake-up; where ranks share cores it
// yields its core between reads instead (Note [Self-tuned waits]).
//
// What follows from having no thread of its own: a send larger than the
// sockets' buffers finishes only while some thread waits on these links (its
// Work's wait(), or any later operation of the communicator), where libgloo's
// loop thread finished it alone; every meshtrain caller waits. A request
// dropped unfinished (an error path freeing its buffer) must be withdrawn
// first: Posted does it (Links::cancel). No TCP_USER_TIMEOUT on these
// sockets: a busy receiver's full window must not look like a dead host.

#include <poll.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "comm/host_profile.h"
#include "comm/store.h"
#include "comm/transport.h"

namespace meshtrain {
namespace comm {
namespace tcp {

// Request, WaitResult and Posted: the Transport interface's (comm/transport.h).

class Links final : public Transport {
 public:
  // Connects `rank` with every other of `size` ranks: each listens on
  // `bind_host` and publishes its address in `store`; the higher rank of a
  // pair connects. ConfigError/TimeoutError naming `label` on failure.
  Links(Store& store, int rank, int size, const std::string& bind_host, std::chrono::milliseconds timeout,
        const std::string& label);
  // A waiting thread reads the sockets without blocking for up to
  // `waits.spin`, then for up to `waits.yield` more giving its core away
  // (sched_yield) between glances (poll() with no timeout), before it sleeps
  // in poll() (all zero: at once). A wait for a message of more than
  // `waits.large_bytes` yields only `waits.large_yield` (Note [Link waits on
  // shared cores] in host_profile.h).
  void set_waits(const WaitTuning& waits) { waits_ = waits; }
  // Bounds what each connection to a rank of this host holds in flight to
  // `bytes` (0: the kernel's autotuning); links that leave the host keep
  // the kernel's (Note [Link buffers sized to the cache] in host_profile.h).
  // Returns how many links it bounded.
  int set_local_buffer(int64_t bytes);
  ~Links() override;
  Links(const Links&) = delete;
  Links& operator=(const Links&) = delete;

  // `hold`: queue it without writing; it leaves with the next send to `peer`
  // that is not held (in one sendmsg), or when a thread waits on these links.
  RequestPtr send(int peer, uint64_t slot, const void* data, size_t bytes, bool hold = false) override;
  RequestPtr recv(int peer, uint64_t slot, void* data, size_t capacity) override;
  // Progresses every connection until `r` completes, its connection breaks,
  // `timeout` passes with `r` incomplete, or abort() is called.
  WaitResult wait(Request& r, std::chrono::milliseconds timeout) override;
  // Thread-safe: every wait, current and later, returns kAborted.
  void abort() override;
  // The caller is about to free `r`'s buffer without waiting for it (an error
  // path): a posted receive is withdrawn (a message arriving for it now is
  // read and dropped), a queued send is dropped, one partly written is finished
  // from a copy of its rest (the peer expects those bytes). Completed ones: nothing.
  void cancel(Request& r) override;
  // Why the connection to `peer` broke ("" when it has not).
  std::string broken_reason(int peer) const override;
  // Bytes of messages read before their receive was posted, each copied once
  // more from a spare buffer (Note [Large messages wait in the socket]).
  uint64_t early_bytes() const;

 private:
  struct Wire {
    uint64_t slot;
    uint64_t bytes;
  };
  struct Peer;

  Peer& peer_at(int peer) const;  // ConfigError for this rank or one out of range
  void connect_mesh(Store& store, const std::string& bind_host, std::chrono::milliseconds timeout,
                    const std::string& label);
  // Nonblocking I/O on one connection; under mutex_.
  void write_pending(Peer& p);
  void read_available(Peer& p);
  void consume_stage(Peer& p);
  void start_message(Peer& p);
  // A complete header: its message is read now, or held in the socket (Note [Large messages wait in the socket]).
  void hold_or_start(Peer& p);
  void release(Peer& p);  // a held message is read from here on
  void release_held();    // every held message
  void finish_message(Peer& p);
  void break_peer(Peer& p, const std::string& why);
  // Every queued send fails; the next message would start afresh.
  void fail_sends(Peer& p);
  // Writing failed (the peer closed): sends fail, reads go on to the stream's end.
  void break_sends(Peer& p, const std::string& why);
  // `r`'s message of `bytes` does not fit: it fails alone (the caller drops the message).
  void too_large(Request& r, size_t bytes);
  // One blocking poll() round over every connection; called with mutex_ held
  // (released while blocked) by the one polling thread.
  void poll_round(std::unique_lock<std::mutex>& lock, std::chrono::steady_clock::time_point deadline);
  void wake_poller();
  // poll_fds_ and poll_peers_: the wake-up eventfd and every working connection.
  void prepare_poll();
  // poll() on them for up to `timeout_ms` (0: a glance), then writes and reads
  // what is ready; called with mutex_ held, released only while blocked.
  void poll_ready(std::unique_lock<std::mutex>& lock, int timeout_ms);
  // Reads every connection without blocking until `r` completes or the spin budget is spent.
  void spin_round(std::unique_lock<std::mutex>& lock, const Request& r);

  int rank_;
  int size_;
  std::vector<std::unique_ptr<Peer>> peers_;  // by rank; null for this rank
  int wake_fd_ = -1;                          // eventfd: a new send to write, or abort()
  mutable std::mutex mutex_;
  std::condition_variable rounds_;  // a poll round ended (other waiters re-check)
  bool polling_ = false;
  std::vector<pollfd> poll_fds_;  // poll_round's, kept between rounds
  std::vector<Peer*> poll_peers_;
  bool aborted_ = false;
  uint64_t early_bytes_ = 0;  // early_bytes()
  WaitTuning waits_;  // none: a waiter sleeps in poll() at once
};

}  // namespace tcp
}  // namespace comm
}  // namespace meshtrain
