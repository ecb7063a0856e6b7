#pragma once
// GlooProcess: what one process shares among all its Gloo communicators: the
// transport device, the store client, the failure watcher and (when this rank
// hosts it) the store server. See Note [Failure detection] in store_server.cpp.

#include <gloo/transport/device.h>
#include <gloo/transport/unbound_buffer.h>

#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>

#include "meshtrain/comm/store.h"

namespace meshtrain {
namespace comm {
namespace gloo_backend {

struct ProcessConfig {
  int rank = 0;
  int world_size = 1;
  // Namespace of this job attempt in the store ("g0", "g1" after a restart...).
  std::string group = "job";
  // Address the transport binds and advertises to peers.
  std::string bind_host = "127.0.0.1";
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};
};

class GlooProcess {
 public:
  // `server` is non-null when this process hosts the store.
  GlooProcess(ProcessConfig config, std::shared_ptr<TcpStore> store,
              std::unique_ptr<StoreServer> server);
  ~GlooProcess();

  const ProcessConfig& config() const { return config_; }
  std::shared_ptr<gloo::transport::Device>& device() { return device_; }
  const std::shared_ptr<TcpStore>& store() const { return store_; }

  // The first failure reported for this job attempt, if any.
  std::optional<FailureReport> failure() const;
  // Global rank named by a failure's label ("<group>/r<rank>"), or -1.
  static int rank_of_label(const std::string& label);
  // Waits registered here are aborted (abortWaitRecv/Send) when a failure arrives.
  void register_wait(gloo::transport::UnboundBuffer* buf);
  void unregister_wait(gloo::transport::UnboundBuffer* buf);
  // Blocks up to `grace` for a failure report (used when a connection broke
  // and the watcher may name the dead rank a moment later).
  std::optional<FailureReport> await_failure(std::chrono::milliseconds grace) const;

 private:
  void on_failure(const FailureReport& report);

  ProcessConfig config_;
  std::shared_ptr<TcpStore> store_;
  std::unique_ptr<StoreServer> server_;
  std::shared_ptr<gloo::transport::Device> device_;
  std::unique_ptr<FailureWatcher> watcher_;
  mutable std::mutex mutex_;
  std::optional<FailureReport> failure_;
  std::set<gloo::transport::UnboundBuffer*> waiting_;
};

}  // namespace gloo_backend
}  // namespace comm
}  // namespace meshtrain
