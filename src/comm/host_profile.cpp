// The host's waiting costs, measured and cached: Note [Self-tuned waits] in host_profile.h.

#include "comm/host_profile.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <mutex>
#include <sstream>
#include <thread>
#include <vector>

#include "backend.h"
#include "meshtrain/util.h"

namespace meshtrain {
namespace comm {

namespace {

using Clock = std::chrono::steady_clock;

void futex_wait(std::atomic<uint32_t>* word, uint32_t expected) {
  timespec ts{0, 50 * 1000 * 1000};  // re-check every 50 ms: a lost wake-up costs time, never a hang
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT_PRIVATE, expected, &ts, nullptr, 0);
}

void futex_wake(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0);
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
  return v[v.size() / 2];
}

void spin_for(std::chrono::microseconds us) {
  const auto until = Clock::now() + us;
  while (Clock::now() < until) {
  }
}

// One-way futex wake-ups: the waker waits until the sleeper surely sleeps,
// notes the time and wakes it; the sleeper measures from that note.
double measure_wake_us(int rounds) {
  std::atomic<uint32_t> word{0};
  std::atomic<int64_t> sent_ns{0};
  std::vector<double> latencies;
  latencies.reserve(rounds);
  std::thread sleeper([&] {
    for (uint32_t i = 0; i < static_cast<uint32_t>(rounds); ++i) {
      while (word.load(std::memory_order_acquire) != 2 * i + 1) futex_wait(&word, 2 * i);
      const int64_t now = Clock::now().time_since_epoch().count();
      latencies.push_back((now - sent_ns.load(std::memory_order_acquire)) / 1e3);
      word.store(2 * i + 2, std::memory_order_release);
      futex_wake(&word);
    }
  });
  for (uint32_t i = 0; i < static_cast<uint32_t>(rounds); ++i) {
    spin_for(std::chrono::microseconds(40));  // the sleeper is asleep by now
    sent_ns.store(Clock::now().time_since_epoch().count(), std::memory_order_release);
    word.store(2 * i + 1, std::memory_order_release);
    futex_wake(&word);
    while (word.load(std::memory_order_acquire) != 2 * i + 2) futex_wait(&word, 2 * i + 1);
  }
  sleeper.join();
  return median(latencies);
}

// A cache line bounced between two spinning threads; 0 when they do not run
// at once (one core, or a busy host) within the time allowed.
double measure_cache_line_ns(int cores) {
  if (cores < 2) return 0;
  constexpr int kRounds = 2000;
  alignas(64) std::atomic<int> ball{0};
  std::atomic<bool> give_up{false};
  const auto deadline = Clock::now() + std::chrono::milliseconds(20);
  std::thread other([&] {
    for (int i = 0; i < kRounds && !give_up.load(std::memory_order_relaxed); ++i) {
      while (ball.load(std::memory_order_acquire) != 2 * i + 1)
        if (give_up.load(std::memory_order_relaxed)) return;
      ball.store(2 * i + 2, std::memory_order_release);
    }
  });
  const auto start = Clock::now();
  bool done = true;
  for (int i = 0; i < kRounds && done; ++i) {
    ball.store(2 * i + 1, std::memory_order_release);
    while (ball.load(std::memory_order_acquire) != 2 * i + 2) {
      if (Clock::now() > deadline) {
        done = false;
        break;
      }
    }
  }
  const double ns = std::chrono::duration<double, std::nano>(Clock::now() - start).count();
  give_up = true;
  other.join();
  return done ? ns / (2.0 * kRounds) : 0;
}

double measure_copy_gbs() {
  const size_t bytes = 4 << 20;
  std::vector<char> a(bytes, 1), b(bytes, 2);
  double best = 1e30;
  for (int i = 0; i < 6; ++i) {
    const auto t0 = Clock::now();
    std::memcpy(i % 2 ? a.data() : b.data(), i % 2 ? b.data() : a.data(), bytes);
    best = std::min(best, std::chrono::duration<double>(Clock::now() - t0).count());
  }
  return bytes / best / 1e9;
}

std::string cpu_model() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("model name", 0) == 0) {
      const auto colon = line.find(':');
      std::string m = colon == std::string::npos ? "" : line.substr(colon + 1);
      m.erase(0, m.find_first_not_of(" \t"));
      return m;
    }
  }
  return "unknown CPU";
}

// What the CPU reports (cpuid through glibc), else what sysfs says.
int64_t l2_cache_bytes() {
  const long reported = ::sysconf(_SC_LEVEL2_CACHE_SIZE);
  if (reported > 0) return reported;
  for (int i = 0; i < 8; ++i) {  // the level-2 data or unified cache, wherever sysfs lists it
    const std::string dir = str_cat("/sys/devices/system/cpu/cpu0/cache/index", i, "/");
    int level = 0;
    std::string type;
    if (!(std::ifstream(dir + "level") >> level) || level != 2) continue;
    if (!(std::ifstream(dir + "type") >> type) || type == "Instruction") continue;
    std::ifstream in(dir + "size");
    int64_t kb = 0;
    std::string unit;
    return in >> kb >> unit && kb > 0 ? kb << 10 : 0;  // "1024K"
  }
  return 0;
}

std::string cache_path(const std::string& key) {
  std::string boot_id;
  std::ifstream("/proc/sys/kernel/random/boot_id") >> boot_id;
  const size_t hash = std::hash<std::string>()(str_cat(cpu_model(), "|", available_cores(), "|", boot_id, "|", key));
  const char* tmp = std::getenv("TMPDIR");
  char name[64];
  std::snprintf(name, sizeof name, "meshtrain-host-%016zx.txt", hash);
  return str_cat(tmp && *tmp ? tmp : "/tmp", "/", name);
}

bool read_profile(HostProfile& p) {
  std::istringstream fields(read_host_cache("host"));
  // Anyone may write there: figures outside what a machine can measure are not taken.
  return static_cast<bool>(fields >> p.wake_us >> p.cache_line_ns >> p.copy_gbs) && p.wake_us > 0 &&
         p.wake_us < 1e6 && p.cache_line_ns >= 0 && p.cache_line_ns < 1e6 && p.copy_gbs >= 0 && p.copy_gbs < 1e6;
}

void write_profile(const HostProfile& p) {
  char line[128];
  std::snprintf(line, sizeof line, "%.3f %.3f %.3f", p.wake_us, p.cache_line_ns, p.copy_gbs);
  write_host_cache("host", line);
}

}  // namespace

std::string read_host_cache(const std::string& key) {
  std::ifstream in(cache_path(key));
  std::string line;
  std::getline(in, line);
  return line;
}

void write_host_cache(const std::string& key, const std::string& line) {
  const std::string path = cache_path(key);
  std::string tmp = path + ".XXXXXX";
  const int fd = ::mkstemp(&tmp[0]);  // a fresh file of our own, never a link someone left
  if (fd < 0) return;
  const std::string text = line + "\n";
  const bool written = ::write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size());
  ::close(fd);
  if (!written || std::rename(tmp.c_str(), path.c_str()) != 0) ::unlink(tmp.c_str());  // whole or not at all
}

HostProfile measure_host() {
  HostProfile p;
  p.cpu = cpu_model();
  p.cores = available_cores();
  p.wake_us = measure_wake_us(60);
  p.cache_line_ns = measure_cache_line_ns(p.cores);
  p.copy_gbs = measure_copy_gbs();
  p.l2_bytes = l2_cache_bytes();
  return p;
}

const HostProfile& host_profile() {
  static HostProfile profile;
  static std::once_flag once;
  std::call_once(once, [] {
    HostProfile p;
    p.cpu = cpu_model();
    p.cores = available_cores();
    if (read_profile(p)) {
      p.cached = true;
      p.l2_bytes = l2_cache_bytes();
    } else {
      p = measure_host();
      write_profile(p);
    }
    profile = p;
  });
  return profile;
}

WaitTuning choose_wait(const HostProfile& host, bool own_core) {
  const auto budget = [&](int lo, int hi) {
    return std::chrono::microseconds(std::clamp(static_cast<int>(std::lround(2 * host.wake_us)), lo, hi));
  };
  WaitTuning t;
  char buf[200];
  if (own_core) {
    t.spin = budget(5, 200);
    std::snprintf(buf, sizeof buf, "a core per rank: spin 2 x the wake-up (%.1f us), %d us, then sleep",
                  host.wake_us, static_cast<int>(t.spin.count()));
  } else {
    t.yield = budget(20, 200);
    std::snprintf(buf, sizeof buf, "ranks share cores: no spin; yield 2 x the wake-up (%.1f us), %d us, then sleep",
                  host.wake_us, static_cast<int>(t.yield.count()));
  }
  t.why = buf;
  return t;
}

WaitTuning choose_link_wait(const HostProfile& host, bool own_core) {
  WaitTuning t = choose_wait(host, own_core);
  if (own_core) return t;
  t.large_yield = t.yield;
  t.large_bytes = kLinkYieldBytes;
  t.yield = kLinkYield;
  t.why = "ranks share cores: no spin; yield " + std::to_string(t.yield.count()) + " us (messages over " +
          std::to_string(kLinkYieldBytes >> 10) + " KiB: " + std::to_string(t.large_yield.count()) +
          " us), glancing at the sockets between yields, then sleep";
  return t;
}

LinkBuffer choose_link_buffer(const HostProfile& host, int peers_on_host) {
  LinkBuffer b;
  char buf[200];
  if (host.l2_bytes <= 0) {
    b.why = "links: the L2's size is unknown: the kernel's autotuning";
    return b;
  }
  const int peers = std::max(1, peers_on_host);
  b.bytes = std::clamp<int64_t>(host.l2_bytes / peers, 128 << 10, 4 << 20);
  std::snprintf(buf, sizeof buf, "links on this host: %lld KiB in flight each, the L2 (%lld KiB) / %d peer%s here",
                static_cast<long long>(b.bytes >> 10), static_cast<long long>(host.l2_bytes >> 10), peers,
                peers == 1 ? "" : "s");
  b.why = buf;
  return b;
}

std::string describe(const HostProfile& h) {
  char buf[300];
  std::snprintf(buf, sizeof buf, "%s, %d core%s: wake-up %.1f us, cache line %.0f ns, copy %.1f GB/s, L2 %lld KiB%s",
                h.cpu.c_str(), h.cores, h.cores == 1 ? "" : "s", h.wake_us, h.cache_line_ns, h.copy_gbs,
                static_cast<long long>(h.l2_bytes >> 10), h.cached ? " (cached)" : "");
  return buf;
}

}  // namespace comm
}  // namespace meshtrain
