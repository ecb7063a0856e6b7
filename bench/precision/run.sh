#!/usr/bin/env bash
# bf16-mixed against fp32, measured side by side (see docs/BENCHMARKS.md):
# samples/s of one process (1 thread) for the default GPT and for a GPT whose
# matrix products dominate, DDP on 2 ranks (samples/s and all-reduce bytes per
# step, bf16 and fp32 reduction), and the loss curves of a longer run.
#   bench/precision/run.sh        (RUNS=3, STEPS=300 for the curves)
set -euo pipefail
cd "$(dirname "$0")/../.."
RUNS=${RUNS:-3}
STEPS=${STEPS:-300}
OUT=${OUT:-build/bench/precision}; mkdir -p "$OUT"; rm -f "$OUT"/*.json
Q="--eval-problems 0 --log-every 1000"
SMALL="--model gpt --steps 20"
LARGE="--model gpt --layers 4 --hidden 512 --heads 8 --vocab 256 --seq-len 128 --global-batch 16 --steps 8"
for i in $(seq 1 "$RUNS"); do
  for p in fp32 bf16-mixed; do
    OMP_NUM_THREADS=1 build/bin/meshtrain $SMALL $Q --precision $p --metrics-out "$OUT/small_${p}_$i.json" > /dev/null
    OMP_NUM_THREADS=1 build/bin/meshtrain $LARGE $Q --precision $p --metrics-out "$OUT/large_${p}_$i.json" > /dev/null
  done
  build/bin/meshrun --nproc-per-node 2 --master-port 0 -- build/bin/meshtrain $LARGE $Q --dp 2 \
    --metrics-out "$OUT/ddp_fp32_$i.json" > /dev/null
  for r in bf16 fp32; do
    build/bin/meshrun --nproc-per-node 2 --master-port 0 -- build/bin/meshtrain $LARGE $Q --dp 2 \
      --precision bf16-mixed --reduce-dtype $r --metrics-out "$OUT/ddp_bf16_reduce_${r}_$i.json" > /dev/null
  done
done
for p in fp32 bf16-mixed; do
  OMP_NUM_THREADS=1 build/bin/meshtrain --model gpt --steps "$STEPS" $Q --precision $p --metrics-out "$OUT/curve_$p.json" > /dev/null
done
/usr/bin/python3 bench/precision/report.py "$OUT" --doc docs/BENCHMARKS.md \
  --header "Measured $(date -u +%Y-%m-%d) with bench/precision/run.sh (RUNS=$RUNS, STEPS=$STEPS)."
