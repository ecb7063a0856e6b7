#!/usr/bin/env bash
# Eager vs flash attention, one process (see docs/BENCHMARKS.md, Attention):
# activation bytes kept for backward, measured against the planner's count,
# forward + backward time, and the longest T that fits a memory budget.
#   bench/attention/run.sh        (SEQ_LENS=1024,2048,4096,8192 BUDGET_GIB=4)
set -euo pipefail
cd "$(dirname "$0")/../.."
cmake --build build --target benchmarks > /dev/null  # out of the default build
SEQ_LENS=${SEQ_LENS:-1024,2048,4096,8192}
BUDGET_GIB=${BUDGET_GIB:-4}
OUT=${OUT:-build/bench/attention}; mkdir -p "$OUT"
make -C build -j2 bench_attention > /dev/null
# The allocator settings the trainer uses (util/memory): freed blocks are kept for reuse.
MALLOC_TRIM_THRESHOLD_=4294967296 MALLOC_TOP_PAD_=1073741824 \
  build/bin/bench_attention --seq-lens "$SEQ_LENS" --budget-gib "$BUDGET_GIB" | tee "$OUT/table.md"
{ echo "Measured $(date -u +%Y-%m-%d) with bench/attention/run.sh on $(nproc) cores."; echo; cat "$OUT/table.md"; } > "$OUT/section.md"
/usr/bin/python3 bench/section.py docs/BENCHMARKS.md attention "Attention: eager vs flash, activations and time" "$OUT/section.md"
