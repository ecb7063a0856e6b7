#!/usr/bin/env bash
# Context parallelism at long sequences (see docs/BENCHMARKS.md, Context
# parallelism): a Llama's activation bytes per rank and forward + backward
# time on cp 1, 2 and 4 ranks of this host, against the planner's count, and
# the longest T whose planned total fits the budget per rank.
#   bench/cp/run.sh        (SEQ_LENS=1024,2048,4096,8192,16384 BUDGET_GIB=4)
set -euo pipefail
cd "$(dirname "$0")/../.."
cmake --build build --target benchmarks > /dev/null  # out of the default build
SEQ_LENS=${SEQ_LENS:-1024,2048,4096,8192,16384}
BUDGET_GIB=${BUDGET_GIB:-4}
OUT=${OUT:-build/bench/cp}; mkdir -p "$OUT"
make -C build -j2 bench_cp meshrun > /dev/null
# The allocator settings the trainer uses (util/memory): freed blocks are kept for reuse.
export MALLOC_TRIM_THRESHOLD_=4294967296 MALLOC_TOP_PAD_=1073741824
: > "$OUT/rows.md"
for cp in 1 2 4; do
  build/bin/meshrun --nproc-per-node "$cp" --master-port 0 --threads-per-rank 1 -- \
    build/bin/bench_cp --seq-lens "$SEQ_LENS" --budget-gib "$BUDGET_GIB" | sed 's/^\[rank[0-9]*\]: //' | tee -a "$OUT/rows.md"
done
{
  echo "Measured $(date -u +%Y-%m-%d) with bench/cp/run.sh on $(nproc) cores: Llama 2 layers, hidden 128, 4 heads"
  echo "(2 key/value), vocab 512, fp32, one sample per step, one thread per rank, every rank on this host."
  echo "Activations: heap bytes a forward keeps for backward, the largest over the cp ranks; time: forward +"
  echo "backward of one step after a warm-up (cp ranks share the $(nproc) cores)."
  echo
  echo "| cp | T | positions per rank | activations per rank, measured (MiB) | planned (MiB) | measured / planned | forward + backward (s) |"
  echo "|---:|---:|---:|---:|---:|---:|---:|"
  grep '^|' "$OUT/rows.md"
  echo
  echo "Longest T whose planned total (parameters, gradients, Adam, activations) fits ${BUDGET_GIB} GiB per rank:"
  grep '^LONGEST' "$OUT/rows.md" | awk '{printf "cp %s: %s; ", $2, $3} END {print ""}'
} > "$OUT/section.md"
cat "$OUT/section.md"
/usr/bin/python3 bench/section.py docs/BENCHMARKS.md cp "Context parallelism: activations per rank at long sequences" "$OUT/section.md"
