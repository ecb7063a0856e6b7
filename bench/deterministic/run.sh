#!/usr/bin/env bash
# Issue 33's evidence for --deterministic (docs/dp.md, "Deterministic mode"):
#  1. equality: 100 steps of a GPT (tied embedding, clipping on) on dp 1, 2, 4
#     and 8 x (DDP, ZeRO-1, ZeRO-3) x (no pipeline, pp 2 1F1B) x (fp32,
#     bf16-mixed): every step's loss against dp 1's with ==, and the weights'
#     SHA-256; the normal mode with the same micro-batches for contrast (fp32);
#  2. cost, side by side: step time and memory of the normal mode, the normal
#     mode with the grains' micro-batches, and --deterministic, on the MLP
#     (4 x 1024) and GPT (4 x 512) benches, dp 1 and 2, one thread per rank.
#   bench/deterministic/run.sh        (STEPS=100 RUNS=3)
set -euo pipefail
cd "$(dirname "$0")/../.."
STEPS=${STEPS:-100}; RUNS=${RUNS:-3}
OUT=${OUT:-build/bench/deterministic}; mkdir -p "$OUT"; rm -f "$OUT"/*.json
MR="build/bin/meshrun --master-port 0 --threads-per-rank 1"
Q="--eval-problems 0 --log-every 100000"
GPT="--model gpt --layers 2 --hidden 64 --heads 4 --vocab 64 --seq-len 32 --global-batch 32 --grains 8 --clip-grad-norm 1"
run() {  # ranks out flags...
  local ranks=$1 out=$2; shift 2
  $MR --nproc-per-node "$ranks" -- build/bin/meshtrain $Q "$@" --metrics-out "$OUT/$out.json" > "$OUT/$out.log" 2>&1 ||
    { tail -5 "$OUT/$out.log"; exit 1; }
}
for prec in fp32 bf16-mixed; do
  for strat in ddp zero1 zero3; do
    z=0; [ "$strat" = zero1 ] && z=1; [ "$strat" = zero3 ] && z=3
    for pipe in none pp2; do
      for dp in 1 2 4 8; do
        pp=1; [ "$pipe" = pp2 ] && pp=2
        name="eq_${prec}_${strat}_${pipe}_dp${dp}"
        run $((dp * pp)) "$name" $GPT --steps "$STEPS" --precision $prec --zero $z --dp $dp --pp $pp --deterministic
        if [ "$prec" = fp32 ]; then  # the normal mode, the same 8 micro-batches of 4 samples
          mb="--micro-batch 4"; [ $pp = 2 ] && mb="--microbatches $((8 / dp))"
          run $((dp * pp)) "normal_${strat}_${pipe}_dp${dp}" ${GPT/--grains 8/} --steps "$STEPS" --zero $z --dp $dp \
            --pp $pp $mb
        fi
      done
    done
  done
done
MLP="--model mlp --layers 4 --hidden 1024 --features 1024 --classes 1024 --global-batch 128 --steps 12"
BIG="--model gpt --layers 4 --hidden 512 --heads 8 --vocab 256 --seq-len 128 --global-batch 16 --steps 8"
for i in $(seq 1 "$RUNS"); do
  for model in mlp gpt; do
    flags=$MLP; grain=16; [ $model = gpt ] && { flags=$BIG; grain=2; }
    for dp in 1 2; do
      run $dp "cost_${model}_dp${dp}_normal_$i" $flags --dp $dp
      run $dp "cost_${model}_dp${dp}_grains_$i" $flags --dp $dp --micro-batch $grain
      run $dp "cost_${model}_dp${dp}_deterministic_$i" $flags --dp $dp --deterministic --grains 8
    done
  done
done
/usr/bin/python3 bench/deterministic/report.py "$OUT" --doc docs/dp.md \
  --header "Measured $(date -u +%Y-%m-%d) with bench/deterministic/run.sh (STEPS=$STEPS, RUNS=$RUNS)."
