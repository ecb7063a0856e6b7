#!/usr/bin/env bash
# Does a mixture of experts train like one process? (issue 54, item 15; see
# docs/moe.md, "The balance loss over the global batch"). A Llama with
# --experts 4 --top-k 2 at the default --aux-loss-coef 0.01 on the built-in
# task, STEPS steps on each layout under --aux-loss-scope global (the
# default) and micro (each micro-batch's loss per rank: Megatron-LM's and
# DeepSpeed's); the table gives each run's largest loss difference from one
# process running the global batch at once. Then the global scope's cost: dp 2
# with 4 micro-batches, global against micro side by side (step time, peak
# memory, the dp axis's bytes per step), REPEATS times alternating.
#   bench/moe/equivalence.sh        (STEPS=20 TIMED_STEPS=60 REPEATS=3)
set -euo pipefail
cd "$(dirname "$0")/../.."
STEPS=${STEPS:-20}
TIMED_STEPS=${TIMED_STEPS:-60}
REPEATS=${REPEATS:-3}
OUT=${OUT:-build/bench/moe-equivalence}; mkdir -p "$OUT"
make -C build -j2 meshtrain_cli meshrun > /dev/null
export MALLOC_TRIM_THRESHOLD_=4294967296 MALLOC_TOP_PAD_=1073741824 OMP_NUM_THREADS=1
MODEL="--model llama --experts 4 --top-k 2 --log-every 100000 --eval-problems 0"
run() {  # name ranks flags...
  local name=$1 ranks=$2; shift 2
  if [ "$ranks" = 1 ]; then
    build/bin/meshtrain $MODEL "$@" --metrics-out "$OUT/$name.json" > "$OUT/$name.log" 2>&1
  else
    build/bin/meshrun --nproc-per-node "$ranks" --master-port 0 --threads-per-rank 1 -- \
      build/bin/meshtrain $MODEL "$@" --metrics-out "$OUT/$name.json" > "$OUT/$name.log" 2>&1
  fi
}
run one 1 --steps "$STEPS"
# name ranks flags (the same under both scopes)
LAYOUTS=(
  "dp2|2|--dp 2"
  "dp2-mb2|2|--dp 2 --micro-batch 6"
  "dp2-mb4|2|--dp 2 --micro-batch 3"
  "dp4|4|--dp 4"
  "dp4-mb2|4|--dp 4 --micro-batch 3"
  "ep2|2|--dp 2 --ep 2"
  "ep4|4|--dp 4 --ep 4"
  "ep2-dp4-mb2|4|--dp 4 --ep 2 --micro-batch 3"
  "pp2-mb4|2|--pp 2 --microbatches 4"
  "pp2-dp2-ep2-mb2|4|--dp 2 --pp 2 --ep 2 --microbatches 2"
  "cp2|2|--cp 2"
  "cp2-dp2-ep2|4|--dp 2 --cp 2 --ep 2"
)
for layout in "${LAYOUTS[@]}"; do
  IFS='|' read -r name ranks flags <<< "$layout"
  for scope in global micro; do
    # shellcheck disable=SC2086
    run "$name-$scope" "$ranks" $flags --steps "$STEPS" --aux-loss-scope "$scope"
  done
done
for i in $(seq 1 "$REPEATS"); do
  for scope in global micro; do
    run "timed-$scope-$i" 2 --dp 2 --micro-batch 3 --steps "$TIMED_STEPS" --aux-loss-scope "$scope"
  done
done
/usr/bin/python3 bench/moe/summarize_equivalence.py "$OUT" "$STEPS" "$TIMED_STEPS" "$REPEATS" "${LAYOUTS[@]}" \
  > "$OUT/section.md"
cat "$OUT/section.md"
/usr/bin/python3 bench/section.py docs/BENCHMARKS.md moe-equivalence \
  "Mixture of experts on every layout: the global-batch balance loss against the per-micro-batch one" "$OUT/section.md"
