#pragma once
// Freed memory kept for reuse (Note [Freed memory kept for reuse] in
// src/util/memory.cpp): glibc's malloc stops giving large blocks back to the
// system, so a training step reuses the pages of the last one instead of
// faulting fresh ones in. comm::init_from_env() and the meshtrain tool call
// it; MESHTRAIN_MALLOC=system (or glibc's own MALLOC_MMAP_MAX_ /
// MALLOC_TRIM_THRESHOLD_ in the environment) keeps malloc's defaults.

namespace meshtrain {

// Applies the settings once per process; returns whether they are on.
bool keep_freed_memory_for_reuse();

}  // namespace meshtrain
