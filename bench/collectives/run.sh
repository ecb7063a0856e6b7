#!/usr/bin/env bash
# Collectives: meshtrain (verified and unverified headers) and PyTorch's Gloo,
# interleaved run by run so that machine noise hits all alike.
#   bench/collectives/run.sh            (RUNS=3 SIZES=4K,64K,1M,16M,64M TARGET_S=0.3)
set -euo pipefail
cd "$(dirname "$0")/../.."
RUNS=${RUNS:-3}; SIZES=${SIZES:-4K,64K,1M,16M,64M}; TARGET_S=${TARGET_S:-0.3}
OUT=${OUT:-build/bench/collectives}; mkdir -p "$OUT"; rm -f "$OUT"/*.json
for i in $(seq 1 "$RUNS"); do
  build/bin/meshrun --nproc-per-node 2 --master-port 0 --threads-per-rank 1 -- \
    build/bin/bench_collectives --sizes "$SIZES" --target-s "$TARGET_S" --out "$OUT/meshtrain_$i.json"
  build/bin/meshrun --nproc-per-node 2 --master-port 0 --threads-per-rank 1 -- \
    build/bin/bench_collectives --sizes "$SIZES" --target-s "$TARGET_S" --verify 0 --out "$OUT/meshtrain_noverify_$i.json"
  /usr/bin/python3 bench/collectives/torch_peer.py --sizes "$SIZES" --target-s "$TARGET_S" --out "$OUT/torch_$i.json"
done
/usr/bin/python3 bench/collectives/report.py "$OUT"/meshtrain_[0-9]*.json "$OUT"/meshtrain_noverify_*.json "$OUT"/torch_*.json \
  --doc docs/BENCHMARKS.md --header "Measured $(date -u +%Y-%m-%d) with bench/collectives/run.sh (RUNS=$RUNS)."
