#!/usr/bin/env bash
# Loss parity between layouts, from the command line: the built-in GPT at its
# default size trained by `meshtrain` under meshrun on each layout the issues
# name, against the same run in one process (same seed, same global batch).
# Prints one line per layout: the largest |loss difference| over the steps.
#   scripts/parity.sh [extra meshtrain flags]     (after scripts/setup.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-build/parity}; mkdir -p "$OUT"; rm -f "$OUT"/*.json
FLAGS="--model gpt --eval-problems 0 --log-every 1000 $*"
run() {  # run NAME RANKS LAYOUT-FLAGS...
  local name=$1 ranks=$2; shift 2
  build/bin/meshrun --nproc-per-node "$ranks" --master-port 0 -- build/bin/meshtrain $FLAGS "$@" \
    --metrics-out "$OUT/$name.json" > "$OUT/$name.log" 2>&1 || { tail -20 "$OUT/$name.log"; exit 1; }
}
run one 1
run ddp3 3 --strategy ddp
run dp3 3 --strategy dp
run zero1_3 3 --zero 1
run zero2_3 3 --zero 2
run zero3_3 3 --zero 3
for s in naive gpipe 1f1b; do
  m=8; [ "$s" = naive ] && m=1
  run pp4_$s 4 --pp 4 --schedule "$s" --microbatches "$m"
done
# The default GPT has 4 pieces (embedding, 2 blocks, head): 2 stages x 2 virtual stages.
run pp2_interleaved 2 --pp 2 --schedule interleaved --microbatches 8 --virtual-stages 2
run tp4 4 --tp 4
run tp4_sp 4 --tp 4 --sequence-parallel
run dp2_pp2_tp2_zero1 8 --dp 2 --pp 2 --tp 2 --zero 1
/usr/bin/python3 - "$OUT" <<'PY'
import glob, json, os, sys
d = sys.argv[1]
one = json.load(open(os.path.join(d, "one.json")))["losses"]
print(f"{'layout':<22} {'ranks':>5} {'steps':>5} {'max |loss - one process|':>26}  first loss  last loss")
for path in sorted(glob.glob(os.path.join(d, "*.json"))):
    name = os.path.basename(path)[:-5]
    if name == "one":
        continue
    m = json.load(open(path))
    diff = max(abs(a - b) for a, b in zip(m["losses"], one))
    print(f"{name:<22} {m['world_size']:>5} {len(m['losses']):>5} {diff:>26.2e}  {m['losses'][0]:.6f}  {m['losses'][-1]:.6f}")
print(f"{'one process':<22} {1:>5} {len(one):>5} {'':>26}  {one[0]:.6f}  {one[-1]:.6f}")
PY
