#pragma once
// What waiting costs on this host, measured, and the spin budgets chosen from it.
//
// Note [Self-tuned waits]
// A rank that waits for a peer can spin (burn its core, see the peer's write
// within nanoseconds) or sleep (free the core, pay a wake-up when the peer
// comes). Which is cheaper depends on the host: the wake-up costs 5 us on one
// machine and 50 on another (a VM's idle vCPU, a paravirtualised interrupt),
// and a fixed spin budget tuned on one host either sleeps too early or burns
// too long on the next. So each host is measured once — a futex ping-pong
// between two threads (the wake-up), a cache line bounced between two cores,
// the copy bandwidth — and the budget follows the ski-rental rule: spin for
// as long as a sleep and wake-up would cost (twice the one-way wake-up, from
// 5 to 200 us), then sleep, so that a wait never costs more than twice the
// best choice made in hindsight. It applies only where every rank of the host
// has a core of its own; where ranks share cores nobody spins (a spinning rank
// takes the core its peer needs) and waiters yield first instead.
//
// The figures are measured on first use in a process (~10 ms) and cached in
// $TMPDIR (else /tmp) under a key of the CPU model, the core count and the
// kernel's boot id, so the ranks of a job and later jobs on the same boot
// read them instead of measuring again (figures out of range are measured
// again). Ranks that start together on shared cores measure a busy host: the
// budgets' bounds (200 us) limit what that costs. MESHTRAIN_SHM_SPIN_US,
// MESHTRAIN_SHM_YIELD_US and MESHTRAIN_TCP_SPIN_US still override the choice;
// bench_collectives prints the figures and the choices.

#include <chrono>
#include <cstdint>
#include <string>

namespace meshtrain {
namespace comm {

struct HostProfile {
  std::string cpu;          // the CPU's model name
  int cores = 1;            // cores this process may run on
  double wake_us = 0;       // one futex wake-up, sleeper asleep to running (median)
  double cache_line_ns = 0; // a cache line from one core to another, one way (median; 0 with one core)
  double copy_gbs = 0;      // memcpy of 4 MiB blocks
  int64_t l2_bytes = 0;     // one core's level-2 cache, as the CPU reports it (0: unknown)
  bool cached = false;      // read from the cache file rather than measured by this process
};

// Measures this host now (~10 ms).
HostProfile measure_host();
// This host's profile: measured once per process, or read from the cache file.
const HostProfile& host_profile();

// One line cached for this host and boot under `key` (the file is keyed by
// the CPU model, the core count, the boot id and `key`; see the Note), ""
// when there is none. Anyone may write there: readers check what they read.
std::string read_host_cache(const std::string& key);
// Replaces the line, whole or not at all.
void write_host_cache(const std::string& key, const std::string& line);

struct WaitTuning {
  std::chrono::microseconds spin{0};   // busy-wait this long before sleeping
  std::chrono::microseconds yield{0};  // then (cores shared) sched_yield this long before sleeping
  // Waits for messages over large_bytes yield only large_yield (links: Note [Link waits on shared cores]).
  std::chrono::microseconds large_yield{0};
  int64_t large_bytes = INT64_MAX;
  std::string why;                     // one line: the rule and the figures it used
};

// The spin budgets for a waiter on a host measured as `host` (pure; see the Note).
WaitTuning choose_wait(const HostProfile& host, bool own_core);

// Note [Link waits on shared cores]
// A waiter on the TCP links (tcp::Links) where ranks share cores yields longer
// than one on shared memory: 1 ms, not twice the futex wake-up. Waking from a
// sleep in poll() costs more than a futex wake-up (the loopback's softirq,
// then poll's return), and yielding costs the peers little: sched_yield hands
// the core to whoever is runnable, and each glance at the sockets is one
// poll() with no timeout. OpenMPI's TCP transport, oversubscribed, yields for
// as long as it waits. Only for messages up to 256 KiB: a larger one streams
// through the socket's buffer in many pieces, and four ranks yielding to each
// other on two cores while it does took the 64 MiB broadcast from 44 to
// 89-113 ms in one run of tcp.sh (large ones yield twice the wake-up, as
// shared memory's waiters do). Measured on 4 ranks / 2 cores (AMD EPYC, 2026-12-06,
// medians of 4 interleaved runs, us): a 20 us budget against 1 ms, all-gather
// 4 KiB 119 -> 104, 64 KiB 154 -> 132; all-reduce 64 KiB 270 -> 253, 1 MiB
// 1,104 -> 964; reduce-scatter 64 KiB 163 -> 128; on 8 ranks / 2 cores the
// two were within the noise. With a core per rank the links spin as shared
// memory does (choose_wait). MESHTRAIN_TCP_YIELD_US overrides it.
constexpr std::chrono::microseconds kLinkYield{1000};
constexpr int64_t kLinkYieldBytes = 256 << 10;
WaitTuning choose_link_wait(const HostProfile& host, bool own_core);

// Note [Link buffers sized to the cache]
// Between two ranks of one host a TCP connection is two copies through the
// kernel: the sender's into socket buffers, the receiver's out of them. With
// the kernel's autotuning a loopback sender's socket grows to 4 MiB
// (net.ipv4.tcp_wmem here), more than a core's cache; bounding it (SO_SNDBUF,
// which also ends the autotuning) to about the L2 made large transfers much
// faster. Measured on a 2-vCPU AMD EPYC (L2 1 MiB), 16 MiB over two ranks,
// several interleaved runs: broadcast 4.0-5.6 -> 2.1-2.8 ms, all-gather
// 4.1-5.3 -> 2.4-2.8, all-reduce 6.7-8.5 -> 4.7-5.5; on 4 ranks all-reduce
// 24 -> 17; every bound from 128 KiB to 1 MiB beat the autotuning. Our
// reading is that the receiver then copies bytes still in cache; it is not
// confirmed with cache counters. So each link to a rank of the same host is
// bounded to the L2's size divided by the ranks that send to it at once (its
// peers on the host), at least 128 KiB; links that leave the host keep the
// kernel's autotuning, which sizes them to the path's bandwidth and delay.
// The kernel caps the bound at twice net.core.wmem_max (4 MiB here, 416 KiB
// with Linux's default 212992). MESHTRAIN_TCP_BUFFER_KB overrides the choice
// (0: the kernel's autotuning).
struct LinkBuffer {
  int64_t bytes = 0;  // in flight per link to a rank of this host (0: the kernel's autotuning)
  std::string why;    // one line: the rule and the figures it used
};
LinkBuffer choose_link_buffer(const HostProfile& host, int peers_on_host);

// "AMD EPYC, 2 cores: wake-up 18.2 us, cache line 95 ns, copy 9.6 GB/s, L2 1 MiB (cached)"
std::string describe(const HostProfile& host);

}  // namespace comm
}  // namespace meshtrain
