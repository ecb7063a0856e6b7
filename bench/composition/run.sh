#!/usr/bin/env bash
# ZeRO under pipelining: what each stage costs on the data axis of dp 2 x pp 2
# as the number of micro-batches grows (ZeRO-2 reduce-scatters and ZeRO-3
# re-gathers every micro-batch; DDP and ZeRO-1 reduce once per step).
#   bench/composition/run.sh      (RUNS=3)
set -euo pipefail
cd "$(dirname "$0")/../.."
RUNS=${RUNS:-3}
OUT=${OUT:-build/bench/composition}; mkdir -p "$OUT"; rm -f "$OUT"/*.json
MODEL="--model gpt --layers 6 --hidden 128 --heads 4 --seq-len 32 --global-batch 32 --steps 6 --eval-problems 0 --log-every 100"
for i in $(seq 1 "$RUNS"); do
  for m in 1 2 4 8; do
    for z in 0 1 2 3; do
      build/bin/meshrun --nproc-per-node 4 --master-port 0 -- build/bin/meshtrain $MODEL --dp 2 --pp 2 \
        --schedule 1f1b --microbatches "$m" --zero "$z" --metrics-out "$OUT/zero${z}_m${m}_$i.json" >/dev/null
    done
  done
done
/usr/bin/python3 bench/composition/report.py "$OUT" --doc docs/BENCHMARKS.md \
  --header "Measured $(date -u +%Y-%m-%d) with bench/composition/run.sh (RUNS=$RUNS)."
