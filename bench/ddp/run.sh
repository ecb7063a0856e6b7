#!/usr/bin/env bash
# Data parallelism, measured side by side in one run (see docs/BENCHMARKS.md):
#  1. meshtrain DDP vs PyTorch DDP (Gloo) on the peer's 4 x 1024 MLP, 2 ranks,
#     1 thread each, 64 samples per rank, with the single-process baselines;
#  2. DDP with the all-reduce overlapped with backward vs after backward (MLP, GPT);
#  3. bytes and calls per step: the article's master DP vs DDP, from the trainer's metrics.
#   bench/ddp/run.sh        (RUNS=3 STEPS=20)
set -euo pipefail
cd "$(dirname "$0")/../.."
cmake --build build --target benchmarks > /dev/null  # out of the default build
RUNS=${RUNS:-3}; STEPS=${STEPS:-20}
OUT=${OUT:-build/bench/ddp}; mkdir -p "$OUT"; rm -f "$OUT"/*.json
MR="build/bin/meshrun --master-port 0 --threads-per-rank 1"
for i in $(seq 1 "$RUNS"); do
  /usr/bin/python3 bench/ddp/torch_ddp.py --world-size 1 --steps "$STEPS" --out "$OUT/torch_w1_$i.json"
  /usr/bin/python3 bench/ddp/torch_ddp.py --world-size 2 --steps "$STEPS" --out "$OUT/torch_w2_$i.json"
  $MR --nproc-per-node 1 -- build/bin/bench_ddp --steps "$STEPS" --out "$OUT/mt_w1_$i.json"
  $MR --nproc-per-node 2 -- build/bin/bench_ddp --steps "$STEPS" --out "$OUT/mt_w2_$i.json"
  $MR --nproc-per-node 2 -- build/bin/bench_ddp --steps "$STEPS" --overlap 0 --out "$OUT/mt_w2_nooverlap_$i.json"
  $MR --nproc-per-node 2 -- build/bin/bench_ddp --model gpt --batch 4 --steps 5 --warmup 2 --out "$OUT/mtgpt_w2_$i.json"
  $MR --nproc-per-node 2 -- build/bin/bench_ddp --model gpt --batch 4 --steps 5 --warmup 2 --overlap 0 --out "$OUT/mtgpt_w2_nooverlap_$i.json"
done
for model in mlp gpt; do
  for w in 2 3 4; do
    for s in dp ddp; do
      $MR --nproc-per-node "$w" -- build/bin/meshtrain --model "$model" --strategy "$s" --steps 10 --global-batch 24 \
        --eval-problems 0 --log-every 100 --metrics-out "$OUT/traffic_${model}_${s}_w$w.json" >/dev/null
    done
  done
done
/usr/bin/python3 bench/ddp/report.py "$OUT" --doc docs/BENCHMARKS.md \
  --header "Measured $(date -u +%Y-%m-%d) with bench/ddp/run.sh (RUNS=$RUNS, STEPS=$STEPS)."
