#include "process.h"

#include <gloo/transport/tcp/device.h>

#include <thread>

#include "meshtrain/comm/errors.h"
#include "meshtrain/util/error.h"

namespace meshtrain {
namespace comm {
namespace gloo_backend {

GlooProcess::GlooProcess(ProcessConfig config, std::shared_ptr<TcpStore> store,
                         std::unique_ptr<StoreServer> server)
    : config_(std::move(config)), store_(std::move(store)), server_(std::move(server)) {
  gloo::transport::tcp::attr attr;
  attr.hostname = config_.bind_host;
  try {
    device_ = gloo::transport::tcp::CreateDevice(attr);
  } catch (const std::exception& e) {
    throw ConfigError(str_cat("cannot create the Gloo TCP transport on address '",
                              config_.bind_host, "': ", e.what(),
                              "; set MESHTRAIN_BIND_ADDR to an address of this machine"));
  }
  const std::string prefix = config_.group + "/";
  watcher_.reset(new FailureWatcher(store_->host(), store_->port(), prefix, config_.timeout,
                                    [this](const FailureReport& r) { on_failure(r); }));
  store_->hello(prefix + "r" + std::to_string(config_.rank));
  // A rendezvous wait (gloo exchanging addresses) also ends when a peer dies.
  store_->set_interrupt([this] {
    if (auto f = failure()) {
      throw PeerFailure(str_cat("rank ", rank_of_label(f->label),
                                " failed during the rendezvous: ", f->reason),
                        rank_of_label(f->label));
    }
  });
}

GlooProcess::~GlooProcess() {
  // Order matters: stop watching before anyone may go away legitimately, say
  // goodbye, and, when hosting the store, let the other ranks say theirs.
  if (watcher_) watcher_->stop();
  try {
    store_->bye();
  } catch (const std::exception&) {
    // The store host is gone; nothing to tell it.
  }
  store_.reset();
  if (server_) server_->wait_until_clients_leave(config_.timeout);
  watcher_.reset();
  device_.reset();
}

std::optional<FailureReport> GlooProcess::failure() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return failure_;
}

std::optional<FailureReport> GlooProcess::await_failure(std::chrono::milliseconds grace) const {
  const auto deadline = std::chrono::steady_clock::now() + grace;
  while (std::chrono::steady_clock::now() < deadline) {
    if (auto f = failure()) return f;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return failure();
}

int GlooProcess::rank_of_label(const std::string& label) {
  const auto pos = label.rfind("/r");
  if (pos == std::string::npos) return -1;
  try {
    return std::stoi(label.substr(pos + 2));
  } catch (const std::exception&) {
    return -1;
  }
}

void GlooProcess::register_wait(gloo::transport::UnboundBuffer* buf) {
  std::lock_guard<std::mutex> lock(mutex_);
  waiting_.insert(buf);
  if (failure_) {
    buf->abortWaitRecv();
    buf->abortWaitSend();
  }
}

void GlooProcess::unregister_wait(gloo::transport::UnboundBuffer* buf) {
  std::lock_guard<std::mutex> lock(mutex_);
  waiting_.erase(buf);
}

void GlooProcess::on_failure(const FailureReport& report) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (failure_) return;
  failure_ = report;
  for (auto* buf : waiting_) {
    buf->abortWaitRecv();
    buf->abortWaitSend();
  }
}

}  // namespace gloo_backend
}  // namespace comm
}  // namespace meshtrain
