#!/usr/bin/env bash
# The trainer in two builds side by side (runs alternated): median step time,
# bytes sent per step by rank 0, and the largest loss difference, for a set of
# layouts (SET=zero: the ZeRO-3 layouts; SET=tp: tensor and sequence
# parallelism; SET=dp: DDP and ZeRO-1/2, accumulating over micro-batches). How the 'before and after' tables in docs/BENCHMARKS.md were
# measured:
#   git worktree add /tmp/old REV && (cd /tmp/old && cmake -S . -B build -DCMAKE_BUILD_TYPE=Release &&
#     make -C build -j2 meshrun meshtrain_cli)
#   SET=tp bench/compare/builds.sh /tmp/old/build/bin build/bin      (RUNS=3)
set -euo pipefail
cd "$(dirname "$0")/../.."
OLD=${1:?old build/bin}; NEW=${2:-build/bin}; RUNS=${RUNS:-3}; SET=${SET:-zero}
OUT=${OUT:-build/bench/compare_builds}; mkdir -p "$OUT"; rm -f "$OUT"/*.json
GPT="--model gpt --layers 6 --hidden 256 --heads 4 --vocab 128 --seq-len 64 --global-batch 16 --steps 20 --eval-problems 0 --log-every 1000"
# name:ranks:flags
case "$SET" in
  zero) LAYOUTS=("dp2_fp32:2:--zero 3" "dp2_bf16:2:--zero 3 --precision bf16-mixed"
                 "dp2pp2_fp32:4:--zero 3 --dp 2 --pp 2 --microbatches 4"
                 "dp2pp2il_fp32:4:--zero 3 --dp 2 --pp 2 --microbatches 4 --schedule interleaved --virtual-stages 2") ;;
  tp) LAYOUTS=("tp2:2:--tp 2" "tp2_sp:2:--tp 2 --sequence-parallel" "tp4_sp:4:--tp 4 --sequence-parallel"
               "dp2tp2_zero3:4:--dp 2 --tp 2 --zero 3" "pp2tp2_bf16:4:--pp 2 --tp 2 --microbatches 4 --precision bf16-mixed") ;;
  dp) LAYOUTS=("ddp2_accum:2:--micro-batch 4" "ddp2_bf16_accum:2:--micro-batch 4 --precision bf16-mixed"
               "zero1_accum:2:--zero 1 --micro-batch 4" "zero2_accum:2:--zero 2 --micro-batch 4"
               "ddp3:3:--global-batch 18") ;;
  *) echo "SET must be zero, tp or dp"; exit 2 ;;
esac
run() {  # run NAME RANKS BIN FLAGS...
  local name=$1 n=$2 bin=$3; shift 3
  "$bin/meshrun" --nproc-per-node "$n" --master-port 0 -- "$bin/meshtrain" $GPT "$@" --metrics-out "$OUT/$name.json" \
    > "$OUT/$name.log" 2>&1 || { echo "FAILED: $name"; tail -5 "$OUT/$name.log"; exit 1; }
}
for r in $(seq 1 "$RUNS"); do
  for v in old new; do
    bin=$OLD; [ "$v" = new ] && bin=$NEW
    for l in "${LAYOUTS[@]}"; do
      IFS=: read -r name n flags <<< "$l"
      # shellcheck disable=SC2086
      run "${name}_${v}_$r" "$n" "$bin" $flags
    done
  done
done
NAMES=$(for l in "${LAYOUTS[@]}"; do echo "${l%%:*}"; done)
/usr/bin/python3 - "$OUT" $NAMES <<'PY'
import glob, json, statistics, sys
d = sys.argv[1]
print("| layout | old ms/step | new ms/step | new / old | old bytes/step | new bytes/step | max abs loss difference |")
print("|---|---|---|---|---|---|---|")
for cfg in sys.argv[2:]:
    t, b, losses = {}, {}, {}
    for v in ["old", "new"]:
        runs = [json.load(open(f)) for f in sorted(glob.glob(f"{d}/{cfg}_{v}_*.json"))]
        t[v] = statistics.median(m["step_time_s"] for m in runs) * 1e3
        b[v] = int(runs[0]["ranks"][0]["traffic"]["total"]["bytes_sent"])
        losses[v] = runs[0]["losses"]
    diff = max(abs(x - y) for x, y in zip(losses["old"], losses["new"]))
    print(f"| {cfg} | {t['old']:.1f} | {t['new']:.1f} | {t['new'] / t['old']:.2f} | {b['old']:,} | {b['new']:,} | {diff:.2e} |")
PY
