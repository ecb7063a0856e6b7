#!/usr/bin/env bash
# The planner's predicted step time against the trainer's measured one, on 2
# namespaced test hosts (tests/cluster/hosts.sh, needs root) of 2 ranks each,
# for 10 layouts of 4 ranks (issue 30 item 4: 8 or more within 25%).
#
#   bench/plan/cluster_time.sh [--dry-run] [--steps N]
#
# The link figures are the planner's flags for these hosts; set them from
# measurements on a quiet machine (bench/collectives), not from this script:
#   RATE         each host's link, shaped with tc tbf (default 1gbit)
#   INTER_BW     --inter-node-bandwidth: RATE in bytes/s (default 125MB/s for 1gbit)
#   INTER_LAT    --inter-node-latency: a Gloo TCP message over the veth (default 100us)
#   INTRA_BW     --intra-node-bandwidth: meshtrain's shared-memory transport (default 2GB/s)
#   INTRA_LAT    --intra-node-latency (default 20us)
#   THREADS      threads per rank (default 1; OMP_NUM_THREADS)
#   TFLOPS       --device-tflops (default: calibrate: the rate one process of THREADS threads
#                achieves on this model, times the share of the machine's cores each of the 4
#                ranks gets; 'measure' times a 1024^3 matmul instead, which this small model's
#                256-wide products and elementwise work do not reach)
# --dry-run prints the predictions and the commands without training (seconds).
# Prints: layout, predicted s, measured s (mean step time after the first),
# error; and how many layouts are within 25%. Run it on a quiet machine: the
# measurement is the wall time of each step.
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN=${BIN:-build/bin}
HOSTS=tests/cluster/hosts.sh
RATE=${RATE:-1gbit} INTER_BW=${INTER_BW:-125MB/s} INTER_LAT=${INTER_LAT:-100us}
INTRA_BW=${INTRA_BW:-2GB/s} INTRA_LAT=${INTRA_LAT:-20us} THREADS=${THREADS:-1} TFLOPS=${TFLOPS:-calibrate}
STEPS=6 DRY=0
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --steps) STEPS=$2; shift ;;
    *) echo "usage: $0 [--dry-run] [--steps N]" >&2; exit 2 ;;
  esac
  shift
done

# A GPT small enough for CPU ranks, large enough that communication shows.
MODEL="--model gpt --layers 8 --hidden 256 --heads 8 --vocab 1024 --seq-len 128"
BATCH="--global-batch 16 --micro-batch 2"
CLUSTER="--devices 4 --devices-per-node 2 --device-memory 4GB --intra-node-bandwidth $INTRA_BW \
  --inter-node-bandwidth $INTER_BW --intra-node-latency $INTRA_LAT --inter-node-latency $INTER_LAT"
# name | trainer's layout flags | planner's schedule flags
LAYOUTS=(
  "dp4|--dp 4 --zero 0|"
  "dp4-no-overlap|--dp 4 --zero 0 --no-overlap|--no-overlap"
  "dp4-zero1|--dp 4 --zero 1|"
  "dp4-zero2|--dp 4 --zero 2|"
  "dp4-zero3|--dp 4 --zero 3|"
  "dp2-tp2|--dp 2 --tp 2|"
  "dp2-pp2|--dp 2 --pp 2 --schedule 1f1b --microbatches 4|"
  "dp2-pp2-interleaved|--dp 2 --pp 2 --schedule interleaved --microbatches 4 --virtual-stages 2|--schedule interleaved --virtual-stages 2"
  "pp2-tp2|--pp 2 --tp 2 --schedule 1f1b --microbatches 8|"
  "pp4|--pp 4 --schedule 1f1b --microbatches 8|"
  "tp4|--tp 4|"
)

export OMP_NUM_THREADS=$THREADS OPENBLAS_NUM_THREADS=$THREADS
# The planner's predicted step for one layout (dp pp tp zero) under its schedule flags.
predict() {
  # shellcheck disable=SC2086
  "$BIN/meshtrain" plan $MODEL $BATCH $CLUSTER --device-tflops "$TFLOPS" --precision fp32 $5 --json 2>/dev/null |
    python3 -c '
import json, sys
dp, pp, tp, zero = map(int, sys.argv[1:5])
plan = json.load(sys.stdin)
for c in plan.get("candidates", []):
    l = c["layout"]
    if (l["dp"], l["pp"], l["tp"], l["zero"]) == (dp, pp, tp, zero):
        print("%.6f" % c["step_seconds"]); break
else:
    print("nan")' "$1" "$2" "$3" "$4"
}
flag() { echo "$1" | sed -n "s/.*--$2 \([0-9]*\).*/\1/p"; }

# The device rate: the model's FLOPs per step (the planner's compute time at 1
# TFLOP/s) over one process's measured step, times the cores a rank gets when 4
# ranks share this machine's.
calibrate() {
  local metrics=/tmp/cluster_time_one.$$.json flops
  # shellcheck disable=SC2086
  flops=$("$BIN/meshtrain" plan $MODEL $BATCH --devices 1 --device-memory 4GB --device-tflops 1 --precision fp32 \
          --json 2>/dev/null | python3 -c 'import json,sys; print(json.load(sys.stdin)["candidates"][0]["compute_seconds"] * 1e12)')
  # shellcheck disable=SC2086
  "$BIN/meshtrain" $MODEL $BATCH --precision fp32 --steps "$STEPS" --log-every 1000 --eval-problems 0 \
    --metrics-out "$metrics" >/dev/null 2>&1
  python3 -c 'import json,sys,os
flops, path, threads = float(sys.argv[1]), sys.argv[2], int(sys.argv[3])
step = json.load(open(path))["step_time_s"]
share = min(1.0, os.cpu_count() / (4 * threads))
print("%.6f" % (flops / step / 1e12 * share))' "$flops" "$metrics" "$THREADS"
  rm -f "$metrics"
}
if [ "$TFLOPS" = calibrate ]; then
  TFLOPS=$(calibrate)
  echo "device rate: $TFLOPS TFLOP/s per rank (one process of $THREADS thread(s) on this model, times the share of $(nproc --all) cores a rank gets among 4)"
fi

NAME="mtb$$" SUBNET="10.199.$(($$ % 250))"
if [ "$DRY" = 0 ]; then
  "$HOSTS" up "$NAME" 2 "$SUBNET" >/dev/null
  trap '"$HOSTS" down "$NAME" 2' EXIT
  "$HOSTS" shape "$NAME" 0 "$RATE"
  "$HOSTS" shape "$NAME" 1 "$RATE"
  echo "0123456789abcdef0123456789abcdef" > "/tmp/$NAME.token"
fi
printf "%-22s %12s %12s %8s\n" layout "predicted s" "measured s" error
within=0 total=0
for entry in "${LAYOUTS[@]}"; do
  IFS='|' read -r name flags plan_flags <<< "$entry"
  dp=$(flag "$flags" dp); pp=$(flag "$flags" pp); tp=$(flag "$flags" tp); zero=$(flag "$flags" zero)
  predicted=$(predict "${dp:-1}" "${pp:-1}" "${tp:-1}" "${zero:-0}" "$plan_flags")
  train="$BIN/meshtrain $MODEL $BATCH $flags --precision fp32 --steps $STEPS --log-every 1000 --eval-problems 0"
  if [ "$DRY" = 1 ]; then
    printf "%-22s %12s %12s %8s  %s\n" "$name" "$predicted" "-" "-" "$train"
    continue
  fi
  metrics="/tmp/$NAME.$name.json"
  node() {
    "$HOSTS" run "$NAME" "$1" "$BIN/meshrun" --nnodes 2 --node-rank "$1" --nproc-per-node 2 \
      --threads-per-rank "$THREADS" --master-addr "$SUBNET.1" --master-port 29617 \
      --rdzv-token-file "/tmp/$NAME.token" --quiet -- $train "${@:2}"
  }
  node 1 > "/tmp/$NAME.$name.n1.log" 2>&1 &
  node 0 --metrics-out "$metrics" > "/tmp/$NAME.$name.n0.log" 2>&1 || echo "$name failed: /tmp/$NAME.$name.n0.log"
  wait
  measured=$(python3 -c 'import json,sys; print("%.6f" % json.load(open(sys.argv[1]))["step_time_s"])' "$metrics" \
             2>/dev/null || echo nan)
  read -r error ok < <(python3 -c 'import sys; p, m = map(float, sys.argv[1:]); e = p / m - 1
print("%+.1f%%" % (100 * e), int(abs(e) <= 0.25))' "$predicted" "$measured" 2>/dev/null || echo "- 0")
  printf "%-22s %12s %12s %8s\n" "$name" "$predicted" "$measured" "$error"
  within=$((within + ok)) total=$((total + 1))
done
[ "$DRY" = 1 ] || echo "$within of $total layouts within 25% (RATE $RATE, $THREADS thread(s) per rank, TFLOP/s $TFLOPS)"
