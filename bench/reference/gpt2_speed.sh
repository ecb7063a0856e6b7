#!/usr/bin/env bash
# GPT-2 124M (12 x 768, vocabulary 50257 padded to 50304, B 4, T 64) trained on
# this machine, side by side in one run, the programs alternated ROUNDS times:
#   meshtrain, one process, fp32 and bf16-mixed; meshtrain DDP on 2 ranks;
#   llm.c's train_gpt2 (CPU, OpenMP, 2 threads) when LLMC_BIN is given;
#   an eager PyTorch GPT-2 (bench/reference/torch_gpt2.py, python3-torch);
#   meshtrain generate with and without its key/value cache.
# meshtrain keeps freed memory for reuse (src/util/memory.cpp); the eager
# PyTorch peer is run with the same glibc settings through its environment
# (without them it spends most of a step in page faults), and meshtrain once
# with MESHTRAIN_MALLOC=system to show what the setting is worth.
# Everything starts from the same llm.c checkpoint of random weights written by
# tests/fixtures/make_reference_models.py --gpt2-124m.
#   LLMC_BIN=/path/to/train_gpt2 ROUNDS=2 bench/reference/gpt2_speed.sh
# LLMC_BIN is llm.c's train_gpt2.c built outside this repository and changed to
# read gpt2_124m.bin and tokens_124m.bin from its working directory, to run 10
# steps, and to skip validation and sampling (docs/BENCHMARKS.md, "GPT-2 124M").
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-build/gpt2-speed}
ROUNDS=${ROUNDS:-2}
STEPS=${STEPS:-10}
mkdir -p "$OUT"
[ -f "$OUT/gpt2_124m.bin" ] || /usr/bin/python3 tests/fixtures/make_reference_models.py --gpt2-124m "$OUT"
CKPT=$(realpath "$OUT/gpt2_124m.bin")
SHARD=$(realpath "$OUT/tokens_124m.bin")
TRAIN="build/bin/meshtrain --model gpt2 --init-from $CKPT --data $SHARD --no-shuffle --seq-len 64 --global-batch 4
       --steps $STEPS --lr 1e-4 --eval-problems 0 --log-every 1000"
for r in $(seq 1 "$ROUNDS"); do
  echo "round $r of $ROUNDS" >&2
  if [ -n "${LLMC_BIN:-}" ]; then
    (cd "$OUT" && OMP_NUM_THREADS=2 "$LLMC_BIN") > "$OUT/llmc_$r.txt"
  fi
  $TRAIN --metrics-out "$OUT/fp32_$r.json" > /dev/null
  MESHTRAIN_MALLOC=system $TRAIN --metrics-out "$OUT/fp32sys_$r.json" > /dev/null
  $TRAIN --precision bf16-mixed --metrics-out "$OUT/bf16_$r.json" > /dev/null
  MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=1073741824 MALLOC_TOP_PAD_=67108864 /usr/bin/python3 bench/reference/torch_gpt2.py "$CKPT" "$SHARD" --steps "$STEPS" > "$OUT/torch_$r.json"
  build/bin/meshrun --master-port 0 --quiet --nproc-per-node 2 -- $TRAIN --dp 2 --metrics-out "$OUT/ddp2_$r.json" > /dev/null
  for cache in cache no-cache; do
    flag=""; [ "$cache" = no-cache ] && flag="--no-cache"
    build/bin/meshtrain generate --init-from "$CKPT" --prompt-ids 50256 --max-new-tokens 64 --temperature 0 $flag \
      --out "$OUT/generate_${cache}_$r.json" > /dev/null 2>&1
  done
done
/usr/bin/python3 - "$OUT" "$ROUNDS" <<'EOF'
import json, re, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
def steps(kind, r):  # seconds of steps after the first (allocation, first touch)
    p = f"{out}/{kind}_{r}"
    if kind == "llmc":
        try:
            ms = [float(m) for m in re.findall(r"took ([0-9.]+) ms", open(p + ".txt").read())]
        except FileNotFoundError:
            return None
        return [x / 1000 for x in ms[1:]]
    j = json.load(open(p + ".json"))
    return (j["step_seconds"] if kind == "torch" else j["step_times_s"])[1:]
rows = []
for kind, name in [("fp32", "meshtrain, 1 process, fp32"),
                   ("fp32sys", "meshtrain, 1 process, fp32, MESHTRAIN_MALLOC=system"), ("bf16", "meshtrain, 1 process, bf16-mixed"),
                   ("ddp2", "meshtrain, DDP on 2 ranks, fp32"), ("llmc", "llm.c train_gpt2 (OpenMP, 2 threads)"),
                   ("torch", "eager PyTorch (2 threads, same malloc settings)")]:
    per_round = [steps(kind, r) for r in range(1, rounds + 1)]
    if any(s is None for s in per_round):
        continue
    rows.append((name, statistics.median(x for s in per_round for x in s)))
base = dict(rows).get("llm.c train_gpt2 (OpenMP, 2 threads)")
# One denominator for every program (Note [An honest MFU]): the peak meshtrain's
# first fp32 run measured at start, over the model FLOPs it counts per step.
first = json.load(open(f"{out}/fp32_1.json"))
flops, peak = first["model_flops_per_step"], first["peak_flops"]
print(f"MFU below: {flops / 1e9:.1f} GFLOP per step over a peak of {peak / 1e9:.1f} GFLOP/s ({first['peak_source']})")
print("| program | s/step (median) | tokens/s | MFU | vs llm.c |")
print("|---|---|---|---|---|")
for name, s in rows:
    ratio = f"{base / s:.2f}x" if base else "-"
    print(f"| {name} | {s:.3f} | {256 / s:.1f} | {100 * flops / s / peak:.1f}% | {ratio} |")
for cache in ("cache", "no-cache"):
    g = [json.load(open(f"{out}/generate_{cache}_{r}.json")) for r in range(1, rounds + 1)]
    tps = statistics.median(len(x["generated_ids"]) / (x["prefill_seconds"] + x["decode_seconds"]) for x in g)
    print(f"| meshtrain generate, 64 tokens, {'with' if cache == 'cache' else 'without'} the KV cache | - | {tps:.1f} | - | - |")
EOF
