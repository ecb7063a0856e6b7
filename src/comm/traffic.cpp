#include "meshtrain/comm.h"

#include <cstdio>
#include <sstream>

namespace meshtrain {
namespace comm {

const char* op_name(OpKind kind) {
  switch (kind) {
    case OpKind::kSend: return "send";
    case OpKind::kRecv: return "recv";
    case OpKind::kBroadcast: return "broadcast";
    case OpKind::kAllReduce: return "all_reduce";
    case OpKind::kReduce: return "reduce";
    case OpKind::kAllGather: return "all_gather";
    case OpKind::kReduceScatter: return "reduce_scatter";
    case OpKind::kGather: return "gather";
    case OpKind::kScatter: return "scatter";
    case OpKind::kAllToAll: return "all_to_all";
    case OpKind::kBarrier: return "barrier";
    case OpKind::kVerify: return "verify";
    case OpKind::kCount: break;
  }
  return "?";
}

OpTraffic& OpTraffic::operator+=(const OpTraffic& o) {
  calls += o.calls;
  bytes_sent += o.bytes_sent;
  bytes_received += o.bytes_received;
  inter_host_sent += o.inter_host_sent;
  inter_host_received += o.inter_host_received;
  return *this;
}

OpTraffic& OpTraffic::operator-=(const OpTraffic& o) {
  calls -= o.calls;
  bytes_sent -= o.bytes_sent;
  bytes_received -= o.bytes_received;
  inter_host_sent -= o.inter_host_sent;
  inter_host_received -= o.inter_host_received;
  return *this;
}

OpTraffic Traffic::payload_total() const {
  OpTraffic total;
  for (int k = 0; k < kNumOpKinds; ++k) {
    if (k != static_cast<int>(OpKind::kVerify)) total += ops[k];
  }
  return total;
}

Traffic Traffic::operator-(const Traffic& before) const {
  Traffic d = *this;
  for (int k = 0; k < kNumOpKinds; ++k) d.ops[k] -= before.ops[k];
  return d;
}

Traffic Traffic::operator+(const Traffic& other) const {
  Traffic s = *this;
  for (int k = 0; k < kNumOpKinds; ++k) s.ops[k] += other.ops[k];
  return s;
}

std::string Traffic::table(const std::string& title) const {
  std::ostringstream os;
  if (!title.empty()) os << title << "\n";
  char line[160];
  std::snprintf(line, sizeof line, "%-15s %10s %16s %16s\n", "op", "calls", "bytes sent",
                "bytes received");
  os << line;
  for (int k = 0; k < kNumOpKinds; ++k) {
    const OpTraffic& t = ops[k];
    if (t.calls == 0 && t.bytes_sent == 0 && t.bytes_received == 0) continue;
    std::snprintf(line, sizeof line, "%-15s %10lld %16lld %16lld\n",
                  op_name(static_cast<OpKind>(k)), static_cast<long long>(t.calls),
                  static_cast<long long>(t.bytes_sent),
                  static_cast<long long>(t.bytes_received));
    os << line;
  }
  const OpTraffic total = payload_total();
  std::snprintf(line, sizeof line, "%-15s %10lld %16lld %16lld\n", "total (payload)",
                static_cast<long long>(total.calls), static_cast<long long>(total.bytes_sent),
                static_cast<long long>(total.bytes_received));
  os << line;
  if (total.inter_host_sent != 0 || total.inter_host_received != 0) {
    std::snprintf(line, sizeof line, "%-15s %10s %16lld %16lld\n", "  across hosts", "",
                  static_cast<long long>(total.inter_host_sent), static_cast<long long>(total.inter_host_received));
    os << line;
  }
  return os.str();
}

void TrafficCounter::add_call(OpKind kind) {
  std::lock_guard<std::mutex> lock(mutex_);
  traffic_[kind].calls += 1;
}

void TrafficCounter::add_sent(OpKind kind, int64_t bytes, bool remote) {
  std::lock_guard<std::mutex> lock(mutex_);
  traffic_[kind].bytes_sent += bytes;
  if (remote) traffic_[kind].inter_host_sent += bytes;
}

void TrafficCounter::add_received(OpKind kind, int64_t bytes, bool remote) {
  std::lock_guard<std::mutex> lock(mutex_);
  traffic_[kind].bytes_received += bytes;
  if (remote) traffic_[kind].inter_host_received += bytes;
}

void TrafficCounter::add(const Traffic& t) {
  std::lock_guard<std::mutex> lock(mutex_);
  traffic_ = traffic_ + t;
}

Traffic TrafficCounter::snapshot() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return traffic_;
}

void TrafficCounter::reset() {
  std::lock_guard<std::mutex> lock(mutex_);
  traffic_ = Traffic{};
}

}  // namespace comm
}  // namespace meshtrain
