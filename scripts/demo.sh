#!/usr/bin/env bash
# The main job: install what is missing, build, and train the GPT on 4 local
# ranks with two strategies combined — a 2-stage pipeline (1F1B) inside, ZeRO-1
# data parallelism across two replicas — on an arithmetic task ("7+5=12").
# Prints progress lines, then the loss curve and the accuracy on held-out
# problems; writes the curve (build/demo-loss.svg) and the pipeline's timeline
# (build/demo-pipeline.json for Perfetto, build/demo-pipeline.svg).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --demo
echo
echo "== the article's toy example: one tensor from rank 0 to rank 1"
build/bin/meshrun --nproc-per-node 2 --master-port 0 -- build/bin/send_recv
echo
echo "== the GPT on 4 ranks: dp 2 (ZeRO stage 1) x pp 2 (1F1B), learning single-digit addition"
build/bin/meshrun --nproc-per-node 4 --master-port 0 -- build/bin/meshtrain \
  --model gpt --dp 2 --pp 2 --zero 1 --schedule 1f1b --microbatches 2 --global-batch 32 \
  --steps 900 --lr 3e-3 --lr-schedule cosine --warmup-steps 50 --log-every 50 --eval-problems 200 \
  --plot build/demo-loss.svg --trace build/demo-pipeline.json --metrics-out build/demo-metrics.json
