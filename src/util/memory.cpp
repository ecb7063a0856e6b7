#include "util/memory.h"

#include <malloc.h>

#include <cstdlib>
#include <string>

namespace meshtrain {

// Note [Freed memory kept for reuse]
// glibc serves a request above its mmap threshold (dynamic, at most 32 MiB)
// with fresh pages from mmap and unmaps them on free, and trims the heap's top
// beyond 128 KiB. A training step allocates the same large tensors every time
// (gradients, activations, the logits, the optimizer's temporaries), so every
// step faulted all of them in again. On the virtual machines this project runs
// on a page fault is expensive: perf showed 20% of a GPT-2 124M step in the
// page-fault handler, and the step took 5.3 s; with mmap off for malloc and no
// trimming, 1.65 s (same losses). The cost: the process keeps its peak heap
// (RSS 3.2 GB there instead of 2.5 GB), as PyTorch's CUDA caching allocator
// keeps its blocks. Large blocks then come from the heap (brk), grown 64 MiB
// at a time.
bool keep_freed_memory_for_reuse() {
  static const bool on = [] {
    const char* choice = std::getenv("MESHTRAIN_MALLOC");
    if (choice && std::string(choice) == "system") return false;
    if (std::getenv("MALLOC_MMAP_MAX_") || std::getenv("MALLOC_TRIM_THRESHOLD_")) return false;  // the user's own
    return mallopt(M_MMAP_MAX, 0) == 1 && mallopt(M_TRIM_THRESHOLD, 1 << 30) == 1 &&
           mallopt(M_TOP_PAD, 64 << 20) == 1;
  }();
  return on;
}

int64_t heap_bytes_in_use() {
  const struct mallinfo2 m = mallinfo2();
  return static_cast<int64_t>(m.uordblks + m.hblkhd);
}

}  // namespace meshtrain
