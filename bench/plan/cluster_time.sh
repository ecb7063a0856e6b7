#!/usr/bin/env bash
# The planner's predicted step time against the trainer's measured one, on 2
# namespaced test hosts (tests/cluster/hosts.sh, needs root) of PER_HOST ranks
# each (issue 30 item 4: 8 or more layouts within 25%): 11 layouts of 4 ranks
# (PER_HOST=2, the default: 4 ranks share this machine's cores), or 10 layouts
# of 2 ranks (PER_HOST=1: on a 2-core machine each rank has a core of its own,
# as each device has its own compute on a real cluster).
#
#   bench/plan/cluster_time.sh [--dry-run] [--steps N]
#
# The link figures are the planner's flags for these hosts:
#   RATE         each host's link, shaped with tc tbf (default 1gbit)
#   INTER_BW     --inter-node-bandwidth (default measure: see below; --dry-run: 125MB/s)
#   INTER_LAT    --inter-node-latency (default measure; --dry-run: 100us)
#                measure: meshtrain's Gloo all_reduce between the two hosts (one rank each,
#                bench_collectives) at 256 KiB and 16 MiB, fitted to the planner's own ring
#                formula, t = 2 (latency + S/2 / bandwidth): what a message between
#                hosts costs this transport here, not the wire's figures (Gloo's per-message
#                cost differs from host to host, issue 32)
#   INTRA_BW     --intra-node-bandwidth: meshtrain's shared-memory transport (default 2GB/s)
#   INTRA_LAT    --intra-node-latency (default 20us)
#   PER_HOST     ranks per host, 1 or 2 (default 2)
#   OVERLAP      1: the planner hides dp reductions behind the backward (its default); 0: it
#                does not (--no-overlap for every layout). Default auto: 0 where a rank has
#                no core beyond its compute thread (cores <= ranks x THREADS): communication
#                over veth links and Gloo's threads is CPU work, and it has no core to run
#                on beside the compute (measured: dp2 with overlap is no faster than without)
#   THREADS      threads per rank (default 1; OMP_NUM_THREADS)
#   TFLOPS       --device-tflops (default: calibrate: the rate one process of THREADS threads
#                achieves on this model, times the share of the machine's cores each of the
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
RATE=${RATE:-1gbit} INTER_BW=${INTER_BW:-measure} INTER_LAT=${INTER_LAT:-measure}
INTRA_BW=${INTRA_BW:-2GB/s} INTRA_LAT=${INTRA_LAT:-20us} THREADS=${THREADS:-1} TFLOPS=${TFLOPS:-calibrate}
PER_HOST=${PER_HOST:-2} OVERLAP=${OVERLAP:-auto}
[ "$PER_HOST" = 1 ] || [ "$PER_HOST" = 2 ] || { echo "PER_HOST must be 1 or 2" >&2; exit 2; }
WORLD=$((2 * PER_HOST))
if [ "$OVERLAP" = auto ]; then OVERLAP=$(( $(nproc --all) > WORLD * THREADS ? 1 : 0 )); fi
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
# name | trainer's layout flags | planner's schedule flags (GPipe's bubble is 1F1B's, sequence
# parallelism moves tp's bytes as reduce-scatter + all-gather: the planner's 1f1b and tp)
LAYOUTS_2=(
  "dp2|--dp 2 --zero 0|"
  "dp2-no-overlap|--dp 2 --zero 0 --no-overlap|--no-overlap"
  "dp2-zero1|--dp 2 --zero 1|"
  "dp2-zero2|--dp 2 --zero 2|"
  "dp2-zero3|--dp 2 --zero 3|"
  "pp2-1f1b|--pp 2 --schedule 1f1b --microbatches 8|"
  "pp2-gpipe|--pp 2 --schedule gpipe --microbatches 8|"
  "pp2-interleaved|--pp 2 --schedule interleaved --microbatches 8 --virtual-stages 2|--schedule interleaved --virtual-stages 2"
  "tp2|--tp 2|"
  "tp2-sp|--tp 2 --sequence-parallel|"
)
LAYOUTS_4=(
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

if [ "$WORLD" = 2 ]; then LAYOUTS=("${LAYOUTS_2[@]}"); else LAYOUTS=("${LAYOUTS_4[@]}"); fi
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
share = min(1.0, os.cpu_count() / (int(sys.argv[4]) * threads))
print("%.6f" % (flops / step / 1e12 * share))' "$flops" "$metrics" "$THREADS" "$WORLD"
  rm -f "$metrics"
}
if [ "$TFLOPS" = calibrate ]; then
  TFLOPS=$(calibrate)
  echo "device rate: $TFLOPS TFLOP/s per rank (one process of $THREADS thread(s) on this model, times the share of $(nproc --all) cores a rank gets among $WORLD)"
fi

NAME="mtb$$" SUBNET="10.199.$(($$ % 250))"
if [ "$DRY" = 0 ]; then
  "$HOSTS" up "$NAME" 2 "$SUBNET" >/dev/null
  trap '"$HOSTS" down "$NAME" 2' EXIT
  "$HOSTS" shape "$NAME" 0 "$RATE"
  "$HOSTS" shape "$NAME" 1 "$RATE"
  echo "0123456789abcdef0123456789abcdef" > "/tmp/$NAME.token"
fi
# The planner's figures for the link between the hosts: latency and bandwidth
# fitted to meshtrain's Gloo all_reduce of 2 ranks, one per host.
measure_link() {
  local out=/tmp/$NAME.link.json
  for node in 1 0; do
    MESHTRAIN_BACKEND=gloo "$HOSTS" run "$NAME" "$node" "$BIN/meshrun" --nnodes 2 --node-rank "$node" \
      --nproc-per-node 1 --threads-per-rank "$THREADS" --master-addr "$SUBNET.1" --master-port 29616 \
      --rdzv-token-file "/tmp/$NAME.token" --quiet -- "$BIN/bench_collectives" --ops all_reduce \
      --sizes 256K,16M --target-s 1 --out "$out" > /dev/null 2>&1 &
  done
  wait
  python3 -c 'import json, sys
(s1, t1), (s2, t2) = [(r["bytes"], r["sec_per_op"]) for r in json.load(open(sys.argv[1]))["rows"]]
bw = (s2 - s1) / (t2 - t1)
print("%.0fB/s %.0fus" % (bw, max(0.0, (t1 - s1 / bw) / 2) * 1e6))' "$out"
  rm -f "$out"
}
if [ "$INTER_BW" = measure ] || [ "$INTER_LAT" = measure ]; then
  if [ "$DRY" = 1 ]; then
    bw=125MB/s lat=100us
  else
    read -r bw lat < <(measure_link)
    echo "link between the hosts (Gloo all_reduce of 256 KiB and 16 MiB, fitted): $bw, latency $lat"
  fi
  [ "$INTER_BW" = measure ] && INTER_BW=$bw
  [ "$INTER_LAT" = measure ] && INTER_LAT=$lat
fi
CLUSTER="--devices $WORLD --devices-per-node $PER_HOST --device-memory 4GB --intra-node-bandwidth $INTRA_BW \
  --inter-node-bandwidth $INTER_BW --intra-node-latency $INTRA_LAT --inter-node-latency $INTER_LAT"
printf "%-22s %12s %12s %8s\n" layout "predicted s" "measured s" error
within=0 total=0
for entry in "${LAYOUTS[@]}"; do
  IFS='|' read -r name flags plan_flags <<< "$entry"
  dp=$(flag "$flags" dp); pp=$(flag "$flags" pp); tp=$(flag "$flags" tp); zero=$(flag "$flags" zero)
  [ "$OVERLAP" = 1 ] || [[ "$plan_flags" == *--no-overlap* ]] || plan_flags="$plan_flags --no-overlap"
  predicted=$(predict "${dp:-1}" "${pp:-1}" "${tp:-1}" "${zero:-0}" "$plan_flags")
  train="$BIN/meshtrain $MODEL $BATCH $flags --precision fp32 --steps $STEPS --log-every 1000 --eval-problems 0"
  if [ "$DRY" = 1 ]; then
    printf "%-22s %12s %12s %8s  %s\n" "$name" "$predicted" "-" "-" "$train"
    continue
  fi
  metrics="/tmp/$NAME.$name.json"
  node() {
    "$HOSTS" run "$NAME" "$1" "$BIN/meshrun" --nnodes 2 --node-rank "$1" --nproc-per-node "$PER_HOST" \
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
[ "$DRY" = 1 ] || echo "$within of $total layouts within 25% (2 hosts x $PER_HOST, RATE $RATE, link $INTER_BW $INTER_LAT, overlap $OVERLAP, $THREADS thread(s) per rank, TFLOP/s $TFLOPS)"
