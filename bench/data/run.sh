#!/usr/bin/env bash
# The issue's 300-step comparison redone: about 4 MB of English text (vim's
# help files, on every Debian machine), a GPT trained the same way three times
# on 2 ranks (dp 2), the held-out loss from the same held-out documents:
#   shards, shuffled        meshtrain data --val-fraction; --data 'PREFIX_train_*.bin' (the default order)
#   shards, --no-shuffle    the same shards in file order (what the trainer did before)
#   text file               the same training text as one file, random windows (--data FILE)
#   bench/data/run.sh        (STEPS=300)
set -euo pipefail
cd "$(dirname "$0")/../.."
STEPS=${STEPS:-300}
OUT=${OUT:-build/bench/data}; rm -rf "$OUT"; mkdir -p "$OUT/text"
# ~4 MB: the help files in name order until the size is reached.
size=0
for f in /usr/share/vim/vim90/doc/*.txt; do
  cp "$f" "$OUT/text/"
  size=$((size + $(stat -c %s "$f")))
  [ "$size" -ge 4000000 ] && break
done
build/bin/meshtrain data --val-fraction 0.05 --out "$OUT/bytes" "$OUT"/text/*.txt > "$OUT/data.txt"
# The same training and held-out documents as two text files (byte tokens, no separators: as the shards).
/usr/bin/python3 - "$OUT" <<'EOF'
import struct, sys, glob
out = sys.argv[1]
for split in ("train", "val"):
    with open(f"{out}/{split}.txt", "wb") as w:
        for shard in sorted(glob.glob(f"{out}/bytes_{split}_*.bin")):
            data = open(shard, "rb").read()
            n = struct.unpack("<i", data[8:12])[0]
            w.write(bytes(struct.unpack(f"<{n}H", data[1024:1024 + 2 * n])))
EOF
FLAGS="--model gpt --layers 4 --hidden 128 --heads 4 --seq-len 128 --global-batch 32 --steps $STEPS --lr 2e-3
       --eval-every 100 --val-batches 8 --eval-problems 0 --log-every 1000"
run() {  # name, data flags
  build/bin/meshrun --master-port 0 --quiet --nproc-per-node 2 -- build/bin/meshtrain $FLAGS --dp 2 $2 \
    --metrics-out "$OUT/$1.json" > /dev/null
}
run shuffled "--data $OUT/bytes_train_*.bin --val-data $OUT/bytes_val_*.bin"
run file_order "--data $OUT/bytes_train_*.bin --val-data $OUT/bytes_val_*.bin --no-shuffle"
run text_file "--data $OUT/train.txt --val-data $OUT/val.txt"
/usr/bin/python3 - "$OUT" <<'EOF'
import json, sys
out = sys.argv[1]
print(open(f"{out}/data.txt").read().strip().splitlines()[-2])
print("| order | train loss (mean of the last 20 steps) | held-out loss at " +
      " / ".join(str(int(s)) for s in json.load(open(f"{out}/shuffled.json"))["eval_steps"]) + " |")
print("|---|---|---|")
for name, what in [("shuffled", "token shards, shuffled (default)"), ("file_order", "token shards, --no-shuffle"),
                   ("text_file", "one text file, random windows")]:
    m = json.load(open(f"{out}/{name}.json"))
    tail = m["losses"][-20:]
    print(f"| {what} | {sum(tail) / len(tail):.3f} | " + " / ".join(f"{x:.3f}" for x in m["eval_losses"]) + " |")
EOF
