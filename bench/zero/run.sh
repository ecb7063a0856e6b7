#!/usr/bin/env bash
# ZeRO stages vs DDP in one run: per-rank model-state bytes against the ZeRO
# paper's fp32-Adam model, traffic per step, peak RSS and step time.
#   bench/zero/run.sh       (RUNS=3; a GPT of 8 layers x 128 hidden, 2 and 4 ranks)
set -euo pipefail
cd "$(dirname "$0")/../.."
RUNS=${RUNS:-3}
OUT=${OUT:-build/bench/zero}; mkdir -p "$OUT"; rm -f "$OUT"/*.json
MODEL="--model gpt --layers 8 --hidden 128 --heads 4 --seq-len 32 --global-batch 16 --steps 8 --eval-problems 0 --log-every 100"
for i in $(seq 1 "$RUNS"); do
  for n in 2 4; do
    for z in 0 1 2 3; do
      build/bin/meshrun --nproc-per-node "$n" --master-port 0 -- build/bin/meshtrain $MODEL --zero "$z" \
        --metrics-out "$OUT/zero${z}_n${n}_$i.json" >/dev/null
    done
  done
done
/usr/bin/python3 bench/zero/report.py "$OUT" --doc docs/BENCHMARKS.md --header "Measured $(date -u +%Y-%m-%d) with bench/zero/run.sh (RUNS=$RUNS)."
