#!/usr/bin/env bash
# Checkpoint throughput: save (every rank writes its shard, fsync, commit) and
# load (read, SHA-256 verify, assemble), and the time a save blocks the
# training loop against the step time, synchronous and with --async-save
# (snapshot at the step boundary, written in the background); and the
# checksum's throughput. GPT 8 x 256 (AdamW state).
#   bench/checkpoint/run.sh     (RUNS=3)
set -euo pipefail
cd "$(dirname "$0")/../.."
cmake --build build --target benchmarks > /dev/null  # out of the default build
RUNS=${RUNS:-3}
OUT=${OUT:-build/bench/checkpoint}; rm -rf "$OUT"; mkdir -p "$OUT"
GPT="--model gpt --layers 8 --hidden 256 --heads 8 --vocab 256 --seq-len 32 --global-batch 16 --eval-problems 0 --log-every 100"
for i in $(seq 1 "$RUNS"); do
  for layout in "--dp 2" "--dp 2 --async-save" "--dp 2 --zero 3" "--dp 2 --zero 3 --async-save" "--pp 2" "--pp 2 --async-save"; do
    tag=$(echo "$layout" | tr -d ' -')
    rm -rf "$OUT/ckpt"
    build/bin/meshrun --nproc-per-node 2 --master-port 0 -- build/bin/meshtrain $GPT $layout --steps 6 \
      --save-dir "$OUT/ckpt" --save-every 2 --metrics-out "$OUT/save_${tag}_$i.json" > /dev/null
    build/bin/meshrun --nproc-per-node 2 --master-port 0 -- build/bin/meshtrain $GPT $layout --steps 7 \
      --save-dir "$OUT/ckpt" --resume --metrics-out "$OUT/load_${tag}_$i.json" > /dev/null
  done
done
build/bin/bench_checkpoint_hash 256 > "$OUT/hash.txt"
/usr/bin/python3 bench/checkpoint/report.py "$OUT" --doc docs/BENCHMARKS.md --header "Measured $(date -u +%Y-%m-%d) with bench/checkpoint/run.sh (RUNS=$RUNS)."
