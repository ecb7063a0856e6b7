#pragma once
// Freed memory kept for reuse (Note [Freed memory kept for reuse] in
// src/util/memory.cpp): glibc's malloc stops giving large blocks back to the
// system, so a training step reuses the pages of the last one instead of
// faulting fresh ones in. comm::init_from_env() and the meshtrain tool call
// it; MESHTRAIN_MALLOC=system (or glibc's own MALLOC_MMAP_MAX_ /
// MALLOC_TRIM_THRESHOLD_ in the environment) keeps malloc's defaults.

#include <cstdint>

namespace meshtrain {

// Applies the settings once per process; returns whether they are on.
bool keep_freed_memory_for_reuse();

// Bytes in use on the heap (glibc's mallinfo2: every arena and the mmapped
// chunks): what a forward keeps for backward is the difference around it.
int64_t heap_bytes_in_use();

}  // namespace meshtrain
