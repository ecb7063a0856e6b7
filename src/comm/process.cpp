#include "process.h"

#include <gloo/transport/tcp/device.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <thread>

#include "meshtrain/comm/errors.h"
#include "meshtrain/util/error.h"

namespace meshtrain {
namespace comm {

std::string host_identity() {
  const char* forced = std::getenv("MESHTRAIN_HOST_ID");
  if (forced && *forced) return forced;
  char name[256] = {0};
  gethostname(name, sizeof name - 1);
  std::string boot_id;
  std::ifstream("/proc/sys/kernel/random/boot_id") >> boot_id;
  return std::string(name) + "/" + boot_id;
}

Process::Process(ProcessConfig config, std::shared_ptr<TcpStore> store,
                 std::unique_ptr<StoreServer> server)
    : config_(std::move(config)), store_(std::move(store)), server_(std::move(server)) {
  const std::string prefix = config_.group + "/";
  watcher_.reset(new FailureWatcher(store_->host(), store_->port(), prefix, config_.timeout,
                                    [this](const FailureReport& r) { on_failure(r); }, store_->token()));
  // Before hello: a rank refused here must not be reported dead under the label of the rank it collided with.
  const int64_t claims = store_->add(prefix + "claims/r" + std::to_string(config_.rank), 1);
  MESHTRAIN_CHECK(claims == 1, "rank ", config_.rank, " has already joined the store at ", store_->host(), ":",
                  store_->port(), ": another job is using the same MASTER_PORT, or two processes were given RANK=",
                  config_.rank, "; give each job its own port (meshrun --standalone or --master-port 0 picks a free one)");
  store_->hello(prefix + "r" + std::to_string(config_.rank));
  store_->set(prefix + "host/" + std::to_string(config_.rank), config_.host_id);
  // A rendezvous wait (exchanging addresses or segment names) also ends when a peer dies.
  store_->set_interrupt([this] {
    if (auto f = failure()) {
      throw PeerFailure(str_cat("rank ", rank_of_label(f->label),
                                " failed during the rendezvous: ", f->reason),
                        rank_of_label(f->label));
    }
  });
}

Process::~Process() {
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

std::shared_ptr<gloo::transport::Device> Process::gloo_device() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!device_) {
    gloo::transport::tcp::attr attr;
    attr.hostname = config_.bind_host;
    try {
      device_ = gloo::transport::tcp::CreateDevice(attr);
    } catch (const std::exception& e) {
      throw ConfigError(str_cat("cannot create the Gloo TCP transport on address '", config_.bind_host,
                                "': ", e.what(), "; set MESHTRAIN_BIND_ADDR to an address of this machine"));
    }
  }
  return device_;
}

void Process::load_hosts() {
  if (!hosts_.empty()) return;
  std::vector<std::string> hosts(config_.world_size);
  for (int r = 0; r < config_.world_size; ++r) {
    hosts[r] = store_->get(config_.group + "/host/" + std::to_string(r));
  }
  hosts_ = std::move(hosts);
}

const std::string& Process::host_of(int global_rank) {
  load_hosts();
  return hosts_.at(global_rank);
}

int Process::ranks_on_my_host() {
  load_hosts();
  int n = 0;
  for (const auto& h : hosts_) n += h == hosts_[config_.rank];
  return n;
}

std::optional<FailureReport> Process::failure() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return failure_;
}

std::optional<FailureReport> Process::await_failure(std::chrono::milliseconds grace) const {
  const auto deadline = std::chrono::steady_clock::now() + grace;
  while (std::chrono::steady_clock::now() < deadline) {
    if (auto f = failure()) return f;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return failure();
}

int Process::rank_of_label(const std::string& label) {
  const auto pos = label.rfind("/r");
  if (pos == std::string::npos) return -1;
  try {
    return std::stoi(label.substr(pos + 2));
  } catch (const std::exception&) {
    return -1;
  }
}

void Process::register_wait(gloo::transport::UnboundBuffer* buf) {
  std::lock_guard<std::mutex> lock(mutex_);
  waiting_.insert(buf);
  if (failure_) {
    buf->abortWaitRecv();
    buf->abortWaitSend();
  }
}

void Process::unregister_wait(gloo::transport::UnboundBuffer* buf) {
  std::lock_guard<std::mutex> lock(mutex_);
  waiting_.erase(buf);
}

int Process::add_failure_listener(std::function<void()> wake) {
  std::lock_guard<std::mutex> lock(mutex_);
  const int id = next_listener_++;
  listeners_[id] = std::move(wake);
  return id;
}

void Process::remove_failure_listener(int id) {
  std::lock_guard<std::mutex> lock(mutex_);
  listeners_.erase(id);
}

void Process::on_failure(const FailureReport& report) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (failure_) return;
  failure_ = report;
  failed_.store(true, std::memory_order_release);
  for (auto* buf : waiting_) {
    buf->abortWaitRecv();
    buf->abortWaitSend();
  }
  for (auto& kv : listeners_) kv.second();
}

}  // namespace comm
}  // namespace meshtrain
