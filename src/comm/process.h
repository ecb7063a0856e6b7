#pragma once
// Process: what one rank shares among all its communicators, whatever their
// backend: the store client, the failure watcher, the host of every rank
// and, when this rank hosts it, the store server. See Note [Failure detection]
// in store_server.cpp.

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "comm/store.h"

namespace meshtrain {
namespace comm {

struct ProcessConfig {
  int rank = 0;
  int world_size = 1;
  // Namespace of this job attempt in the store ("g0", "g1" after a restart...).
  std::string group = "job";
  // Address the Gloo transport binds and advertises to peers.
  std::string bind_host = "127.0.0.1";
  // This machine's identity (host_identity()), published for every rank.
  std::string host_id = "localhost";
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};
};

// The identity of this machine: MESHTRAIN_HOST_ID when set (tests make two
// "hosts" on one machine with it), else the host name and the kernel's boot id.
// Ranks with equal identities share memory.
std::string host_identity();

class Process {
 public:
  // `server` is non-null when this process hosts the store.
  Process(ProcessConfig config, std::shared_ptr<TcpStore> store, std::unique_ptr<StoreServer> server);
  ~Process();

  const ProcessConfig& config() const { return config_; }
  const std::shared_ptr<TcpStore>& store() const { return store_; }

  // Host identity of a global rank (read from the store once, then cached).
  const std::string& host_of(int global_rank);
  // How many ranks of the job share this rank's host.
  int ranks_on_my_host();

  // The first failure reported for this job attempt, if any.
  std::optional<FailureReport> failure() const;
  // Cheap check for hot wait loops.
  bool failed() const { return failed_.load(std::memory_order_acquire); }
  // Global rank named by a failure's label ("<group>/r<rank>"), or -1.
  static int rank_of_label(const std::string& label);
  // "global rank 3 died (<reason>)", or "global rank 3 stopped making progress
  // (<what>)" for a rank reported stuck; the reason alone when the store's host
  // is what went away (no rank to name: "lost the connection to the rendezvous store ...").
  static std::string describe(const FailureReport& failure);
  // The error for a failure this rank learned of while in `where`: TimeoutError
  // for a rank reported stuck (it is alive), PeerFailure for a death.
  [[noreturn]] static void raise_failure(const std::string& where, const FailureReport& failure);
  // This rank waited in vain for global rank `peer` (`what`: the operation,
  // starting with `where`). The store is told, once, so that every rank (and
  // meshrun) names the stuck rank, not the first rank to give up; then raises
  // the TimeoutError (`what`, where the wait chain leads, `hint`), or the
  // PeerFailure another rank's report already explains.
  [[noreturn]] void raise_stuck(int peer, const std::string& where, const std::string& what, const std::string& hint);
  // A wait of this rank for global rank `peer` has been long (-1: it ended):
  // recorded in the store, so that a rank timing out on this one follows the
  // chain to the rank that waits for no one (Note [Naming a stuck rank]).
  void note_waiting(int peer);
  // Blocks up to `grace` for a failure report (used when a connection broke
  // and the watcher may name the dead rank a moment later).
  std::optional<FailureReport> await_failure(std::chrono::milliseconds grace) const;

  // Blocking waits (Gloo's, the TCP links') registered here under `key` are
  // aborted (`abort`, called once, under this object's lock) when a failure
  // arrives. A wait for global rank `peer` still registered after
  // `long_after` is recorded with note_waiting by a recorder thread (a Gloo
  // wait is one blocking call); the record is cleared when it completes and
  // kept when it fails.
  void register_wait(const void* key, int peer, std::chrono::steady_clock::duration long_after,
                     std::function<void()> abort);
  void unregister_wait(const void* key, bool completed);
  // The world is made (join() calls it): from now on a start-up report comes
  // from another job or an extra process, and is not acted on (Note
  // [Start-up reports] in process.cpp).
  void rendezvous_done();

  // Other backends register a callback that wakes their waiters (called once,
  // from the watcher's thread, after failed() became true). Returns an id.
  int add_failure_listener(std::function<void()> wake);
  void remove_failure_listener(int id);

 private:
  void on_failure(const FailureReport& report);
  void check_token_like_rank_0();
  void check_world_size_like_rank_0();
  // Waits until every rank published its host (Note [Start-up reports]).
  void await_every_rank();
  std::string ranks_not_arrived(int from);
  void say_waiting(int from, int64_t waited);
  std::string refused(const std::string& before);
  // The end of the waits-for chain that starts at `peer`, and how the chain
  // goes on from `peer` (", which waits for global rank 2"; "" when it does not).
  std::pair<int, std::string> end_of_wait_chain(int peer);
  // Reports the end of the chain from `peer` as stuck; how the chain goes on,
  // or nullopt when this rank did not report (a failure was known already).
  std::optional<std::string> report_stuck(int peer, const std::string& what);
  void load_hosts();

  ProcessConfig config_;
  std::shared_ptr<TcpStore> store_;
  std::unique_ptr<StoreServer> server_;
  std::unique_ptr<FailureWatcher> watcher_;
  mutable std::mutex mutex_;
  std::optional<FailureReport> failure_;
  bool in_rendezvous_ = true;            // until rendezvous_done()
  bool ignored_startup_report_ = false;  // said once
  std::atomic<bool> failed_{false};
  std::atomic<bool> reported_stuck_{false};
  struct BlockingWait {  // a Gloo or TCP-links wait (register_wait)
    int peer = -1;
    std::chrono::steady_clock::time_point long_at;
    std::function<void()> abort;
  };
  void record_long_waits();  // the recorder thread's loop
  std::map<const void*, BlockingWait> waiting_;
  std::thread recorder_;
  std::condition_variable recorder_wake_;
  bool stopping_ = false;
  bool keep_wait_record_ = false;  // a blocking wait failed: its record stays
  std::map<int, std::function<void()>> listeners_;
  int next_listener_ = 0;
  std::vector<std::string> hosts_;  // by global rank, loaded on first use
};

}  // namespace comm
}  // namespace meshtrain
