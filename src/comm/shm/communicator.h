#pragma once
// ShmCommunicator: the ranks of one host, through one shared-memory segment
// (layout.h). Collectives copy each byte as few times as possible: every rank
// publishes its data in its own buffers, and every rank reduces its own slice
// straight from the peers' buffers, in chunks that stay in cache, the next
// chunk's copy overlapping the peers' reductions (collectives.cpp). Small
// payloads travel in one step: one write, one counter. Point-to-point messages
// use a ring per (sender, receiver) pair (p2p.cpp).
//
// Waiting spins for a moment (only when this host has a core per rank), then
// sleeps on a futex; a peer that makes progress wakes the sleepers. Arguments
// are verified on every collective at no extra step: each rank's header sits
// beside its data and every reader compares them. A dead peer is named through
// the store's failure detection (Process), a stuck one raises TimeoutError.

#include <array>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "../header.h"
#include "../process.h"
#include "../queued.h"
#include "layout.h"
#include "segment.h"

namespace meshtrain {
namespace comm {
namespace shm_backend {

// The segment's layout and one-step threshold as the rank creating the
// segment has them (CommOptions::tuning.shm; all members adopt its values).
// One step is measured unless set (Note [Measured one-step threshold] in one_step.h).
struct ShmSettings {
  size_t buffer_bytes = 256 << 10;
  size_t channel_bytes = 1 << 20;
  size_t small_bytes = 32 << 10;  // where nothing is measured and nothing set
  bool small_set = false;         // ShmTuning::one_step_bytes (MESHTRAIN_SHM_SMALL_KB): nothing to measure
  static ShmSettings of(const ShmTuning& tuning);
};

struct SendOp;
struct RecvOp;
struct Inbox;

class ShmCommunicator final : public QueuedCommunicator {
 public:
  ShmCommunicator(std::shared_ptr<Process> process, std::vector<int> global_ranks, int rank,
                  const std::string& store_prefix, CommOptions options);
  ~ShmCommunicator() override;

  std::string backend() const override { return "shm"; }
  std::string tuning() const override { return tuning_; }

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
  friend struct SendOp;
  friend class SendWork;
  friend class RecvWork;

  // ---- segment access (communicator.cpp)
  RankCtrl& ctrl(int r) const { return *reinterpret_cast<RankCtrl*>(base_ + layout_.ctrl_offset(r)); }
  char* buffer(int r, int which) const { return base_ + layout_.buffer_offset(r, which); }
  ChannelCtrl& channel(int src, int dst) const {
    return *reinterpret_cast<ChannelCtrl*>(base_ + layout_.channel_ctrl_offset(src, dst));
  }
  char* channel_data(int src, int dst) const { return base_ + layout_.channel_data_offset(src, dst); }
  void attach(const std::string& store_prefix);
  // The one-step threshold from the cache or the environment (rank 0, in attach()),
  // or measured by every rank (Note [Measured one-step threshold] in one_step.h).
  void choose_one_step(const ShmSettings& s);
  void measure_one_step();

  // ---- waiting (communicator.cpp)
  // Wakes rank r's sleeping threads, if any.
  void wake(int r) const;
  // Blocks until ready() holds. Throws PeerFailure when a rank of the job
  // died, TimeoutError after the timeout naming blame() (a rank of this
  // communicator): "... while waiting for <waiting_for> from rank q; <unless>".
  void wait_until(const std::function<bool()>& ready, const char* op, const std::function<int()>& blame,
                  const char* waiting_for, const char* unless = nullptr);

  // ---- collective steps (collectives.cpp); see Note [Shared-memory steps]
  void post_step();
  // Waits until every peer (or just `peer` when >= 0) has posted step `target`.
  void wait_step(uint64_t target, const char* op, int peer = -1);
  void wake_peers() const;
  // Publishes this rank's header for the running op (and the largest payload
  // it sends one peer), posts the op's first step, waits for every peer's:
  // every rank's header, in rank order.
  std::vector<Header> open_op(const Header& mine, uint64_t extent, const char* op);
  // MismatchError on every rank when the headers differ (see header_mismatch).
  void verify(const std::vector<Header>& all, const char* op, bool same_shape) const;
  int half() const { return static_cast<int>(op_seq() & 1); }
  void all_reduce_small(at::Tensor& data, ReduceOp op);
  void all_reduce_chunked(at::Tensor& data, ReduceOp op);
  void reduce_scatter_small(const at::Tensor& in, at::Tensor& out, const std::vector<int64_t>& counts,
                            ReduceOp op, const Header& h);
  void reduce_scatter_chunked(const at::Tensor& in, at::Tensor& out, const std::vector<int64_t>& counts,
                              ReduceOp op, const Header& h);
  // Moves out[q] to peer q and receives in[q] from peer q, in rounds of one region.
  struct Span { char* ptr; int64_t bytes; };
  void exchange(const std::vector<Span>& out, const std::vector<Span>& in, int64_t rounds, int first_sub,
                OpKind kind);

  // ---- point to point (p2p.cpp)
  void start_sender();
  void sender_loop();
  // Writes as much of `op` into its ring as fits; true when all of it is written.
  bool push(SendOp& op);
  // Reads what has arrived from `src` (holding inbox.mutex).
  void pull(int src, Inbox& inbox);
  void fail_p2p(const std::exception_ptr& error);

  std::shared_ptr<Process> process_;
  std::string prefix_;
  int splits_ = 0;
  std::unique_ptr<Segment> segment_;
  char* base_ = nullptr;
  SegmentLayout layout_;
  size_t small_bytes_ = 0;
  bool measure_one_step_ = false;  // small_bytes_ is measured once the segment is mapped
  std::string tuning_;             // what was chosen, for tuning()
  int spin_us_ = 0;   // busy-wait this long first (a core per rank)
  int yield_us_ = 0;  // then yield the core this long (more ranks than cores)
  int listener_ = -1;
  uint64_t steps_ = 0;  // steps this rank has posted (the running op's thread only)

  // Point-to-point state.
  std::vector<std::unique_ptr<std::mutex>> send_mutex_;       // per destination
  std::vector<std::deque<std::shared_ptr<SendOp>>> pending_;  // per destination, under send_mutex_
  std::vector<bool> sent_before_;                              // per destination, under send_mutex_
  std::vector<std::unique_ptr<Inbox>> inbox_;                 // per source
  std::mutex sender_mutex_;
  std::condition_variable sender_cv_;
  std::thread sender_;
  bool sender_stop_ = false;
};

}  // namespace shm_backend
}  // namespace comm
}  // namespace meshtrain
