#!/usr/bin/env bash
# Tensor parallelism, measured (see docs/BENCHMARKS.md): parameter bytes per
# rank against 1/tp of the dense model, tp traffic per step against the
# analytic count, and throughput of tp vs dp at the same world size.
#   bench/tp/run.sh        (RUNS=3)
set -euo pipefail
cd "$(dirname "$0")/../.."
RUNS=${RUNS:-3}
OUT=${OUT:-build/bench/tp}; mkdir -p "$OUT"; rm -f "$OUT"/*.json
GPT="--model gpt --layers 4 --hidden 128 --heads 4 --vocab 128 --seq-len 32 --global-batch 16 --steps 6 --eval-problems 0 --log-every 100"
for i in $(seq 1 "$RUNS"); do
  build/bin/meshtrain $GPT --metrics-out "$OUT/dense_$i.json" > /dev/null
  for n in 2 4; do
    build/bin/meshrun --nproc-per-node $n --master-port 0 -- build/bin/meshtrain $GPT --tp $n --metrics-out "$OUT/tp${n}_$i.json" > /dev/null
    build/bin/meshrun --nproc-per-node $n --master-port 0 -- build/bin/meshtrain $GPT --tp $n --sequence-parallel --metrics-out "$OUT/tp${n}sp_$i.json" > /dev/null
    build/bin/meshrun --nproc-per-node $n --master-port 0 -- build/bin/meshtrain $GPT --dp $n --metrics-out "$OUT/dp${n}_$i.json" > /dev/null
  done
done
/usr/bin/python3 bench/tp/report.py "$OUT" --doc docs/BENCHMARKS.md --header "Measured $(date -u +%Y-%m-%d) with bench/tp/run.sh (RUNS=$RUNS)."
