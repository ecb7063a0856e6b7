#!/usr/bin/env bash
# Mixture of experts against a dense model of the same active parameters (see
# docs/BENCHMARKS.md, Mixture of experts): a Llama whose blocks' MLPs are 8
# experts of F each, top-2, against the same Llama with one MLP of 2F, on
# byte-level text; tokens/s and loss after the same steps on one process and
# on 2 ranks (dense: DDP; MoE: --ep 2), and the router's balance (tokens per
# expert) with and without the auxiliary loss.
#   bench/moe/run.sh        (STEPS=200 DATA=/usr/share/common-licenses/GPL-3)
set -euo pipefail
cd "$(dirname "$0")/../.."
STEPS=${STEPS:-200}
DATA=${DATA:-/usr/share/common-licenses/GPL-3}
OUT=${OUT:-build/bench/moe}; mkdir -p "$OUT"
make -C build -j2 meshtrain_cli meshrun > /dev/null
export MALLOC_TRIM_THRESHOLD_=4294967296 MALLOC_TOP_PAD_=1073741824 OMP_NUM_THREADS=1
MODEL="--model llama --layers 4 --hidden 128 --heads 4 --kv-heads 2 --seq-len 64 --global-batch 32 --data $DATA"
MODEL="$MODEL --steps $STEPS --log-every 100000 --eval-problems 0"
run() {  # name ranks flags...
  local name=$1 ranks=$2; shift 2
  if [ "$ranks" = 1 ]; then
    build/bin/meshtrain $MODEL "$@" --metrics-out "$OUT/$name.json" > "$OUT/$name.log" 2>&1
  else
    build/bin/meshrun --nproc-per-node "$ranks" --master-port 0 --threads-per-rank 1 -- \
      build/bin/meshtrain $MODEL "$@" --metrics-out "$OUT/$name.json" > "$OUT/$name.log" 2>&1
  fi
}
run dense-1 1 --ffn-hidden 512
run moe-1 1 --ffn-hidden 256 --experts 8 --top-k 2
run dense-2 2 --ffn-hidden 512
run moe-ep2 2 --ffn-hidden 256 --experts 8 --top-k 2 --ep 2
run moe-noaux-1 1 --ffn-hidden 256 --experts 8 --top-k 2 --aux-loss-coef 0
run moe-aux0.1-1 1 --ffn-hidden 256 --experts 8 --top-k 2 --aux-loss-coef 0.1
/usr/bin/python3 bench/moe/summarize.py "$OUT" "$STEPS" "$DATA" > "$OUT/section.md"
cat "$OUT/section.md"
/usr/bin/python3 bench/section.py docs/BENCHMARKS.md moe "Mixture of experts: against dense, and the router's balance" "$OUT/section.md"
