#!/usr/bin/env bash
# meshtrain's GPT against an independent PyTorch (Python) implementation of the
# same architecture: same initial weights, same batches, torch.optim, per-step
# losses side by side. Needs the peer: scripts/setup.sh --with-peers.
#   bench/reference/run.sh [meshtrain flags]     (default: the trainer's defaults)
set -euo pipefail
cd "$(dirname "$0")/../.."
cmake --build build --target benchmarks > /dev/null  # out of the default build
OUT=${OUT:-build/reference}; rm -rf "$OUT"; mkdir -p "$OUT"
FLAGS="--model gpt --eval-problems 0 --log-every 1000 $*"
build/bin/bench_reference_export "$OUT" $FLAGS
build/bin/meshtrain $FLAGS --metrics-out "$OUT/meshtrain.json" > /dev/null
/usr/bin/python3 bench/reference/torch_gpt.py "$OUT" "$OUT/meshtrain.json"
