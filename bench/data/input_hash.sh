#!/usr/bin/env bash
# What proving the input files costs (Note [Input files are proven, then
# watched]): a 1 GB token shard (SIZE_MB) hashed alone, from the disk and from
# the page cache, beside sha256sum; then a 2-rank job training on it, whose
# step times while the background hash runs and after it are compared in the
# same run. The table goes to docs/BENCHMARKS.md ("Input file hashes").
#   bench/data/input_hash.sh        (SIZE_MB=1000 STEPS=80)
set -euo pipefail
cd "$(dirname "$0")/../.."
cmake --build build --target benchmarks > /dev/null  # out of the default build
SIZE_MB=${SIZE_MB:-1000}
STEPS=${STEPS:-80}
OUT=${OUT:-build/bench/input_hash}; rm -rf "$OUT"; mkdir -p "$OUT"
# llm.c's shard format: a 1 KiB header (magic, version, tokens, vocabulary 256), then uint16 byte ids.
/usr/bin/python3 - "$OUT/big_000000.bin" "$SIZE_MB" <<'PY'
import struct, sys, numpy as np
path, mb = sys.argv[1], int(sys.argv[2])
tokens = (mb * 1000 * 1000 - 1024) // 2
rng = np.random.default_rng(1)
with open(path, "wb") as f:
    f.write(struct.pack("<256i", 20240520, 1, tokens, 256, *([0] * 252)))
    left = tokens
    while left:
        n = min(left, 1 << 24)
        f.write(rng.integers(0, 256, n, dtype=np.uint16).tobytes())
        left -= n
PY
build/bin/bench_input_hash "$OUT/big_000000.bin" 3 | tee "$OUT/hash.json"
sync; /usr/bin/python3 -c "import os; fd = os.open('$OUT/big_000000.bin', os.O_RDONLY); os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)"
build/bin/meshrun --master-port 0 --nproc-per-node 2 -- build/bin/meshtrain --model gpt --layers 2 --hidden 64 \
  --heads 4 --seq-len 64 --global-batch 16 --steps "$STEPS" --data "$OUT/big_*.bin" --eval-problems 0 \
  --log-every 1000 --metrics-out "$OUT/train.json" | tee "$OUT/train.log"
/usr/bin/python3 bench/data/input_hash_report.py "$OUT" ${DOC:+--doc docs/BENCHMARKS.md} \
  --header "Measured $(date -u +%Y-%m-%d) with bench/data/input_hash.sh (SIZE_MB=$SIZE_MB, STEPS=$STEPS)."
