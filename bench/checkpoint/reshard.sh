#!/usr/bin/env bash
# The resharding matrix from the command line: a checkpoint saved at step 3 on
# one layout, resumed on another for steps 3-5, against the same 6 steps in one
# process without interruption. Writes the table into docs/checkpoints.md.
#   bench/checkpoint/reshard.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-build/bench/reshard}; rm -rf "$OUT"; mkdir -p "$OUT"
GPT="--model gpt --layers 4 --heads 4 --steps 6 --eval-problems 0 --log-every 100"
MR="build/bin/meshrun --master-port 0 --nproc-per-node"
$MR 1 -- build/bin/meshtrain $GPT --metrics-out "$OUT/reference.json" > /dev/null 2>&1
i=0
while IFS='|' read -r from_n from to_n to; do
  i=$((i + 1))
  $MR "$from_n" -- build/bin/meshtrain $GPT $from --steps 3 --save-every 3 --save-dir "$OUT/ckpt$i" \
    --metrics-out "$OUT/from$i.json" > /dev/null 2>&1
  $MR "$to_n" -- build/bin/meshtrain $GPT $to --save-dir "$OUT/ckpt$i" --resume \
    --metrics-out "$OUT/to$i.json" > /dev/null 2>&1
  echo "$from_n|$from|$to_n|$to" > "$OUT/move$i.txt"
done <<'MOVES'
2|--dp 2|4|--dp 4
4|--dp 4 --zero 2|2|--dp 2 --zero 2
1||2|--tp 2
4|--dp 2 --tp 2|2|--dp 2
1||2|--pp 2
2|--pp 2 --zero 1|2|--dp 2 --zero 3
2|--dp 2 --zero 3|1|
4|--dp 2 --pp 2 --zero 2|4|--dp 2 --tp 2 --zero 1
3|--dp 3 --zero 3|4|--pp 2 --tp 2
MOVES
/usr/bin/python3 - "$OUT" docs/checkpoints.md <<'PY'
import datetime, glob, json, os, sys
out, doc = sys.argv[1], sys.argv[2]
ref = json.load(open(os.path.join(out, "reference.json")))["losses"]
name = lambda n, flags: f"{n} rank{'s' if n != '1' else ''}" + (f" `{flags.strip()}`" if flags.strip() else ", one process")
rows = [f"Measured {datetime.date.today()} with bench/checkpoint/reshard.sh (GPT 4 layers, AdamW; saved at step 3, "
        "resumed for steps 3-5; reference: the same 6 steps in one process, never interrupted).", "",
        "| saved on | resumed on | resumed from | losses of steps 3-5 | max |difference| to the uninterrupted run |",
        "|---|---|---|---|---|"]
for i in range(1, 100):
    path = os.path.join(out, f"move{i}.txt")
    if not os.path.exists(path):
        break
    fn, ff, tn, tf = open(path).read().strip().split("|")
    m = json.load(open(os.path.join(out, f"to{i}.json")))
    first = m["first_step"]
    diff = max(abs(a - ref[first + k]) for k, a in enumerate(m["losses"]))
    losses = ", ".join(f"{x:.6f}" for x in m["losses"])
    rows.append(f"| {name(fn, ff)} | {name(tn, tf)} | step {first} | {losses} | {diff:.1e} |")
rows += ["", "Reference losses of steps 3-5: " + ", ".join(f"{x:.6f}" for x in ref[3:6]) + "."]
text = open(doc).read()
begin, end = "<!-- reshard:begin -->", "<!-- reshard:end -->"
if begin not in text:
    text = text.rstrip("\n") + "\n\n## The resharding matrix\n\n" + begin + "\n" + end + "\n"
head, rest = text.split(begin)
_, tail = rest.split(end)
open(doc, "w").write(head + begin + "\n" + "\n".join(rows) + "\n" + end + tail)
print("\n".join(rows))
PY
