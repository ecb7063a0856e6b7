#!/usr/bin/env bash
# Pipeline schedules, measured (see docs/BENCHMARKS.md):
#  1. bubble fraction vs (p-1)/(m+p-1) on a synthetic workload (sleeps: F 20 ms,
#     B 40 ms per stage), so the schedule is measured, not the shared cores;
#  2. the GPT on the trainer: throughput of each schedule vs naive model
#     parallelism at the same world size, activations in flight, peak RSS;
#  3. the timelines of GPipe and 1F1B as pictures for the docs.
#   bench/pipeline/run.sh        (RUNS=1)
set -euo pipefail
cd "$(dirname "$0")/../.."
cmake --build build --target benchmarks > /dev/null  # out of the default build
OUT=${OUT:-build/bench/pipeline}; mkdir -p "$OUT" docs/images; rm -f "$OUT"/*.json
MR="build/bin/meshrun --master-port 0"
for p in 2 4; do
  for m in 1 2 4 8; do
    for s in gpipe 1f1b; do
      $MR --nproc-per-node $p -- build/bin/bench_pipeline --schedule $s --microbatches $m --out "$OUT/syn_${s}_p${p}_m$m.json" >/dev/null
    done
    if (( m % p == 0 )); then
      $MR --nproc-per-node $p -- build/bin/bench_pipeline --schedule interleaved --virtual-stages 2 --microbatches $m \
        --out "$OUT/syn_interleaved_p${p}_m$m.json" >/dev/null
    fi
  done
  $MR --nproc-per-node $p -- build/bin/bench_pipeline --schedule naive --microbatches 1 --out "$OUT/syn_naive_p${p}_m1.json" >/dev/null
done
$MR --nproc-per-node 4 -- build/bin/bench_pipeline --schedule gpipe --microbatches 8 --trace docs/images/gpipe_pp4_m8.json >/dev/null
$MR --nproc-per-node 4 -- build/bin/bench_pipeline --schedule 1f1b --microbatches 8 --trace docs/images/1f1b_pp4_m8.json >/dev/null
$MR --nproc-per-node 4 -- build/bin/bench_pipeline --schedule interleaved --virtual-stages 2 --microbatches 8 --trace docs/images/interleaved_pp4_m8_v2.json >/dev/null
$MR --nproc-per-node 4 -- build/bin/bench_pipeline --schedule naive --microbatches 1 --trace docs/images/naive_pp4.json >/dev/null
GPT="--model gpt --layers 8 --hidden 128 --heads 4 --seq-len 32 --global-batch 32 --steps 6 --eval-problems 0 --log-every 100"
for p in 2 4; do
  for s in naive gpipe 1f1b interleaved; do
    m=8; v=1; [ "$s" = naive ] && m=1; [ "$s" = interleaved ] && v=2
    $MR --nproc-per-node $p -- build/bin/meshtrain $GPT --pp $p --schedule $s --microbatches $m --virtual-stages $v \
      --metrics-out "$OUT/gpt_${s}_p$p.json" >/dev/null
  done
done
/usr/bin/python3 bench/pipeline/report.py "$OUT" --doc docs/BENCHMARKS.md --header "Measured $(date -u +%Y-%m-%d) with bench/pipeline/run.sh."
