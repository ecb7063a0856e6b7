#pragma once
// Traffic accounting: per operation kind, the number of calls and the payload
// bytes this rank actually sent and received (the algorithm's real bytes: a ring
// all-reduce of S bytes on n ranks sends 2(n-1)/n * S). The small headers that
// verify arguments across ranks are counted apart, under "verify", so the
// per-operation rows match the algorithms' analytic volumes exactly. The part
// of each row exchanged with ranks on other hosts is counted too (inter_host_*):
// the link between machines is the scarce one.

#include <array>
#include <cstdint>
#include <mutex>
#include <string>

namespace meshtrain {
namespace comm {

enum class OpKind : int {
  kSend = 0,
  kRecv,
  kBroadcast,
  kAllReduce,
  kReduce,
  kAllGather,
  kReduceScatter,
  kGather,
  kScatter,
  kAllToAll,
  kBarrier,
  kVerify,
  kCount  // number of kinds; not an operation
};
constexpr int kNumOpKinds = static_cast<int>(OpKind::kCount);

const char* op_name(OpKind kind);

struct OpTraffic {
  int64_t calls = 0;
  int64_t bytes_sent = 0;
  int64_t bytes_received = 0;
  int64_t inter_host_sent = 0;  // of bytes_sent, to ranks on other hosts
  int64_t inter_host_received = 0;
  OpTraffic& operator+=(const OpTraffic& o);
  OpTraffic& operator-=(const OpTraffic& o);
};

// A snapshot of one communicator's counters.
struct Traffic {
  std::array<OpTraffic, kNumOpKinds> ops{};

  const OpTraffic& operator[](OpKind k) const { return ops[static_cast<int>(k)]; }
  OpTraffic& operator[](OpKind k) { return ops[static_cast<int>(k)]; }
  // Sum over all kinds except kVerify (the payload the algorithms moved).
  OpTraffic payload_total() const;
  Traffic operator-(const Traffic& before) const;
  Traffic operator+(const Traffic& other) const;
  // A table with one row per kind that was used: calls, bytes sent, bytes received.
  std::string table(const std::string& title = "") const;
};

// Thread-safe counters (the worker thread and the caller both record).
class TrafficCounter {
 public:
  void add_call(OpKind kind);
  // `remote`: the peer is on another host.
  void add_sent(OpKind kind, int64_t bytes, bool remote = false);
  void add_received(OpKind kind, int64_t bytes, bool remote = false);
  // Adds every row of `t`, calls included.
  void add(const Traffic& t);
  Traffic snapshot() const;
  void reset();

 private:
  mutable std::mutex mutex_;
  Traffic traffic_;
};

}  // namespace comm
}  // namespace meshtrain
