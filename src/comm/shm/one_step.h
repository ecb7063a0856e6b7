#pragma once
// Where a shared-memory all-reduce stops travelling in one step: chosen from
// measurements of both algorithms on this host, not a constant.
//
// Note [Measured one-step threshold]
// An all-reduce of S bytes on n ranks either goes in one step (every rank
// publishes its tensor and reduces all n of them: one synchronisation, n·S
// bytes reduced per rank) or by chunks (a reduce-scatter and an all-gather:
// two synchronisations per chunk, S reduced and (n-1)/n·S copied back). The
// crossover depends on what a synchronisation costs against a byte, which
// differs by host (a cache line's trip between cores, a wake-up when ranks
// share cores) and by the number of ranks; a cost model from the host's
// measured figures did not predict the crossovers (docs/comm.md), so the
// communicator measures the algorithms themselves. When it is made, its ranks
// time both on float32 tensors from 4 KiB up to the buffer (at most 256 KiB),
// sizes interleaved, the best of three rounds of three operations each. They
// sum their times with a one-step all-reduce, so every rank holds the same
// figures, bit for bit, and computes the same choice: the threshold whose
// operations cost least over the measured sizes, each size's time counted
// relative to the faster algorithm there (a noisy size then weighs no more
// than any other). Below 4 KiB one step always wins (one synchronisation
// against at least two). The figures are cached per host and boot (host_profile.h)
// for this number of ranks, ranks on the host, world size and buffer size, so only the
// first communicator of its kind pays (~2 ms for 2 ranks with a core each, tens
// of ms for 8 ranks on 2 cores). MESHTRAIN_SHM_SMALL_KB overrides the choice.

#include <cstdint>
#include <string>
#include <vector>

namespace meshtrain {
namespace comm {
namespace shm_backend {

struct OneStepTiming {
  int64_t bytes = 0;
  double one_step_us = 0;  // one all-reduce in one step
  double chunked_us = 0;   // one all-reduce by chunks
};

// The sizes measured: 4 KiB, doubling, up to min(buffer, 256 KiB) (one step
// needs the whole tensor in one buffer).
std::vector<int64_t> one_step_candidates(int64_t buffer_bytes);
// The threshold (one of the measured sizes) that costs least, see the Note.
int64_t choose_one_step_bytes(const std::vector<OneStepTiming>& timings);

// The cache's line, and back: false unless it holds a plausible time for
// each of `sizes`, in order.
std::string format_timings(const std::vector<OneStepTiming>& timings);
bool parse_timings(const std::string& line, const std::vector<int64_t>& sizes, std::vector<OneStepTiming>& out);

// "shm one step up to 32 KiB on 4 ranks (<why>)"
std::string describe_one_step(int64_t chosen, int ranks, const std::string& why);
// "shm one step up to 32 KiB on 4 ranks (all_reduce, us one step / chunked: 4K 2.1/3.4 ...) (cached)"
std::string describe_one_step(int64_t chosen, int ranks, const std::vector<OneStepTiming>& timings, bool cached);

}  // namespace shm_backend
}  // namespace comm
}  // namespace meshtrain
