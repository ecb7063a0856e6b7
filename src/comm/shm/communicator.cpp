// ShmCommunicator: the segment's rendezvous, waiting, and split. Collectives
// are in collectives.cpp, point-to-point messages in p2p.cpp.

#include "communicator.h"

#include <immintrin.h>
#include <sched.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>

#include "../backend.h"
#include "comm/host_profile.h"
#include "futex.h"
#include "one_step.h"
#include "p2p.h"
#include "meshtrain/comm.h"
#include "meshtrain/util.h"

namespace meshtrain {
namespace comm {
namespace shm_backend {

ShmSettings ShmSettings::of(const ShmTuning& tuning) {
  ShmSettings s;
  s.buffer_bytes = static_cast<size_t>(tuning.buffer_bytes);
  s.channel_bytes = static_cast<size_t>(tuning.channel_bytes);
  s.small_bytes = std::min<size_t>(tuning.one_step_bytes.value_or(s.small_bytes), s.buffer_bytes);
  s.small_set = tuning.one_step_bytes.has_value();
  return s;
}

ShmCommunicator::ShmCommunicator(std::shared_ptr<Process> process, std::vector<int> global_ranks, int rank,
                                 const std::string& store_prefix, CommOptions options)
    : QueuedCommunicator(std::move(global_ranks), rank, std::move(options)),
      process_(std::move(process)),
      prefix_(store_prefix) {
  // Spinning only pays when every rank of this host has a core of its own;
  // otherwise a spinning rank takes the core its peer needs to make progress.
  // The budgets follow this host's measured wake-up (Note [Self-tuned waits]).
  const WaitTuning tuning = choose_wait(host_profile(), process_->ranks_on_my_host() <= available_cores());
  const ShmTuning& set = options_.tuning.shm;
  spin_us_ = static_cast<int>(set.spin.value_or(tuning.spin).count());
  yield_us_ = static_cast<int>(set.yield.value_or(tuning.yield).count());
  listener_ = process_->add_failure_listener([this] {
    if (!base_) return;
    ctrl(rank_).wake.fetch_add(1);
    futex_wake_all(&ctrl(rank_).wake);
  });
  const int n = size();
  send_mutex_.resize(n);
  pending_.resize(n);
  sent_before_.assign(n, false);
  for (int q = 0; q < n; ++q) send_mutex_[q].reset(new std::mutex);
  inbox_.resize(n);
  for (int q = 0; q < n; ++q) inbox_[q].reset(new Inbox);
  try {
    attach(store_prefix);
    if (measure_one_step_) measure_one_step();
  } catch (...) {
    process_->remove_failure_listener(listener_);
    stop_worker();
    throw;
  }
}

ShmCommunicator::~ShmCommunicator() {
  process_->remove_failure_listener(listener_);
  stop_worker();
  {
    std::lock_guard<std::mutex> lock(sender_mutex_);
    sender_stop_ = true;
  }
  sender_cv_.notify_all();
  if (sender_.joinable()) {
    ctrl(rank_).wake.fetch_add(1);
    futex_wake_all(&ctrl(rank_).wake);
    sender_.join();
  }
  inbox_.clear();
}

// The rank 0 of the communicator creates the segment and publishes its name
// through the store; the others map it and say so in their control block;
// rank 0 removes the name once all have (see segment.h).
void ShmCommunicator::attach(const std::string& store_prefix) {
  const std::string key = store_prefix + "/shm";
  if (rank_ == 0) {
    const ShmSettings s = ShmSettings::of(options_.tuning.shm);
    // Every peer's region must hold a cache line or two (and all_to_all's descriptors).
    layout_ = SegmentLayout{size(), std::max<size_t>(s.buffer_bytes, size() * 256), s.channel_bytes};
    segment_ = Segment::create(layout_.total_bytes());
    auto* header = reinterpret_cast<SegmentHeader*>(segment_->base());
    header->ranks = size();
    header->buffer_bytes = layout_.buffer_bytes;
    header->channel_bytes = layout_.channel_bytes;
    header->total_bytes = layout_.total_bytes();
    choose_one_step(s);
    header->small_bytes = small_bytes_;
    header->measure_one_step = measure_one_step_ ? 1 : 0;
    header->magic = kSegmentMagic;
    process_->store()->set(key, segment_->name());
  } else {
    segment_ = Segment::open(process_->store()->get(key));
  }
  const auto* header = reinterpret_cast<const SegmentHeader*>(segment_->base());
  if (header->magic != kSegmentMagic || header->ranks != size() || header->total_bytes != segment_->size()) {
    throw CommError(str_cat(where("connecting"), ": shared-memory segment ", segment_->name(),
                            " does not belong to this communicator (", header->ranks, " ranks, ",
                            header->total_bytes, " bytes)"));
  }
  layout_ = SegmentLayout{size(), header->buffer_bytes, header->channel_bytes};
  small_bytes_ = header->small_bytes;
  measure_one_step_ = header->measure_one_step != 0;
  if (rank_ != 0 && !measure_one_step_) {
    tuning_ = describe_one_step(static_cast<int64_t>(small_bytes_), size(), "rank 0's choice");
  }
  base_ = segment_->base();
  ctrl(rank_).pid.store(static_cast<int32_t>(::getpid()), std::memory_order_release);
  if (rank_ != 0) {
    wake(0);
    return;
  }
  int missing = 0;
  wait_until(
      [&] {
        for (missing = 0; missing < size(); ++missing) {
          if (ctrl(missing).pid.load(std::memory_order_acquire) == 0) return false;
        }
        return true;
      },
      "connecting", [&] { return missing; }, "its mapping of the shared-memory segment");
  segment_->unlink();
}

// ---- the one-step threshold (Note [Measured one-step threshold] in one_step.h)

namespace {

// The world's size too: tests that pretend to be two hosts (MESHTRAIN_HOST_ID)
// run more ranks on this machine than ranks_on_my_host() counts.
std::string one_step_cache_key(Process& process, int ranks, size_t buffer_bytes) {
  return str_cat("shm-one-step|", ranks, "|", process.ranks_on_my_host(), "|", process.config().world_size, "|",
                 buffer_bytes);
}

}  // namespace

void ShmCommunicator::choose_one_step(const ShmSettings& s) {
  small_bytes_ = s.small_bytes;
  const auto sizes = one_step_candidates(static_cast<int64_t>(layout_.buffer_bytes));
  if (s.small_set || size() == 1 || sizes.empty()) {
    tuning_ = describe_one_step(static_cast<int64_t>(small_bytes_), size(),
                                s.small_set ? "MESHTRAIN_SHM_SMALL_KB"
                                : size() == 1    ? "nothing to measure"
                                                 : "a buffer under 4 KiB: nothing to measure");
    return;
  }
  std::vector<OneStepTiming> timings;
  const std::string key = one_step_cache_key(*process_, size(), layout_.buffer_bytes);
  if (parse_timings(read_host_cache(key), sizes, timings)) {
    small_bytes_ = static_cast<size_t>(choose_one_step_bytes(timings));
    tuning_ = describe_one_step(static_cast<int64_t>(small_bytes_), size(), timings, true);
  } else {
    measure_one_step_ = true;
  }
}

void ShmCommunicator::measure_one_step() {
  using Clock = std::chrono::steady_clock;
  constexpr int kRounds = 3, kOps = 3;
  const auto sizes = one_step_candidates(static_cast<int64_t>(layout_.buffer_bytes));
  const int64_t m = static_cast<int64_t>(sizes.size());
  at::Tensor data = at::zeros({sizes.back() / 4}, at::kFloat);
  auto run = [&](at::Tensor t, bool one_step) {
    SyncCall sync;  // runs inline: see Note [Synchronous calls] in queued.h
    enqueue(OpKind::kAllReduce, "all_reduce", [&](std::vector<at::Tensor>&) {
      one_step ? all_reduce_small(t, ReduceOp::kSum) : all_reduce_chunked(t, ReduceOp::kSum);
    })->wait();
  };
  at::Tensor us = at::full({2 * m}, 1e30, at::kDouble);  // [size][one step, chunked]
  double* best = us.data_ptr<double>();
  for (int round = 0; round < kRounds; ++round) {
    for (int64_t i = 0; i < m; ++i) {
      const at::Tensor t = data.narrow(0, 0, sizes[i] / 4);
      for (int alg = 0; alg < 2; ++alg) {
        run(t, alg == 0);  // lines the ranks up
        const auto start = Clock::now();
        for (int k = 0; k < kOps; ++k) run(t, alg == 0);
        const double each = std::chrono::duration<double, std::micro>(Clock::now() - start).count() / kOps;
        best[2 * i + alg] = std::min(best[2 * i + alg], each);
      }
    }
  }
  run(us, true);  // every rank now holds the same sums, bit for bit
  std::vector<OneStepTiming> timings(m);
  for (int64_t i = 0; i < m; ++i) timings[i] = {sizes[i], best[2 * i] / size(), best[2 * i + 1] / size()};
  small_bytes_ = static_cast<size_t>(choose_one_step_bytes(timings));
  tuning_ = describe_one_step(static_cast<int64_t>(small_bytes_), size(), timings, false);
  if (rank_ == 0) {
    write_host_cache(one_step_cache_key(*process_, size(), layout_.buffer_bytes),
                     format_timings(timings));
  }
  counter_.reset();  // the measurement is not the caller's traffic
}

// ---- waiting

void ShmCommunicator::wake_peers() const {
  std::atomic_thread_fence(std::memory_order_seq_cst);
  for (int q = 0; q < size(); ++q) {
    RankCtrl& c = ctrl(q);
    if (q != rank_ && c.sleepers.load(std::memory_order_relaxed) != 0) {
      c.wake.fetch_add(1, std::memory_order_seq_cst);
      futex_wake_all(&c.wake);
    }
  }
}

void ShmCommunicator::wake(int r) const {
  RankCtrl& c = ctrl(r);
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (c.sleepers.load(std::memory_order_relaxed) != 0) {
    c.wake.fetch_add(1, std::memory_order_seq_cst);
    futex_wake_all(&c.wake);
  }
}

void ShmCommunicator::wait_until(const std::function<bool()>& ready, const char* op,
                                 const std::function<int()>& blame, const char* waiting_for, const char* unless) {
  using Clock = std::chrono::steady_clock;
  if (ready()) return;
  if (spin_us_ > 0) {
    const auto spin_end = Clock::now() + std::chrono::microseconds(spin_us_);
    do {
      for (int i = 0; i < 32; ++i) _mm_pause();
      if (ready()) return;
    } while (Clock::now() < spin_end);
  }
  if (yield_us_ > 0) {
    const auto yield_end = Clock::now() + std::chrono::microseconds(yield_us_);
    do {
      sched_yield();
      if (ready()) return;
    } while (Clock::now() < yield_end);
  }
  const auto deadline = Clock::now() + options_.timeout;
  // A long wait is recorded for whoever times out on this rank (Note [Naming a stuck rank]);
  // the record is cleared when the wait succeeds, kept when it fails (others may still follow it).
  const auto long_wait = Clock::now() + std::max<Clock::duration>(std::chrono::seconds(1), options_.timeout / 4);
  bool noted = false;
  RankCtrl& me = ctrl(rank_);
  while (true) {
    me.sleepers.fetch_add(1, std::memory_order_seq_cst);
    const uint32_t seen = me.wake.load(std::memory_order_seq_cst);
    std::atomic_thread_fence(std::memory_order_seq_cst);
    const bool done = ready();
    const auto now = Clock::now();
    if (!done && !noted && now >= long_wait && !process_->failed()) {
      noted = true;
      process_->note_waiting(global_ranks_[blame()]);
    }
    if (!done && !process_->failed() && now < deadline) {
      // Bounded, so that a wake-up lost to a crash costs 100 ms, not the timeout.
      futex_wait(&me.wake, seen, std::min<Clock::duration>(deadline - now, std::chrono::milliseconds(100)));
    }
    me.sleepers.fetch_sub(1, std::memory_order_seq_cst);
    if (done || ready()) {
      if (noted) process_->note_waiting(-1);
      return;
    }
    if (auto f = process_->failure()) Process::raise_failure(where(op), *f);
    if (Clock::now() >= deadline) {
      const std::string why = unless ? std::string(unless)
                                     : str_cat("that rank is stuck, or did not call ", op,
                                               " (every rank must call collectives in the same order)");
      const std::string what = str_cat(where(op), ": no progress for ", options_.timeout.count(),
                                       " ms while waiting for ", waiting_for, " from ", peer_name(blame()));
      process_->raise_stuck(global_ranks_[blame()], where(op), what, why);  // Note [Naming a stuck rank]
    }
  }
}

// ---- split

std::shared_ptr<Communicator> ShmCommunicator::split(int color, int key, const std::string& label) {
  return split_communicator(*this, process_, prefix_, splits_++, color, key, label);
}

}  // namespace shm_backend
}  // namespace comm
}  // namespace meshtrain
