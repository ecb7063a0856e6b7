#!/usr/bin/env bash
# An elastic job on one machine: two meshrun "nodes" of 2 ranks on loopback
# under --nnodes 1:2. Node 1 is killed (kill -9 of its meshrun) in the middle
# of training: node 0 goes on alone from the last checkpoint, on a layout for
# 2 ranks; node 1 is started again, waits, and the job grows back to 4 ranks
# at the next checkpoint. The global batch never changes, so every step's loss
# is the uninterrupted one-process run's; the table shows both side by side.
#   examples/elastic/run.sh      (after scripts/setup.sh)
set -euo pipefail
cd "$(dirname "$0")/../.."
PORT=${PORT:-29631}
OUT=${OUT:-build/elastic}; rm -rf "$OUT"; mkdir -p "$OUT"
export MESHTRAIN_RDZV_TOKEN=$(openssl rand -hex 32)  # both nodes' shared secret
TRAIN="build/bin/meshtrain --model gpt --steps 60 --global-batch 8 --eval-problems 0 --log-every 1"
JOB="$TRAIN --dp 2 --pp 2 --save-dir $OUT/ckpt --save-every 4 --resume"
NODE="build/bin/meshrun --nnodes 1:2 --nproc-per-node 2 --master-port $PORT --rdzv-last-call 5 --max-restarts 1"

$TRAIN > "$OUT/uninterrupted.log"
$NODE --node-rank 1 -- $JOB > "$OUT/node1.log" 2>&1 &
NODE1=$!
$NODE --node-rank 0 -- $JOB > "$OUT/node0.log" 2>&1 &
NODE0=$!
until grep -q "step   15/" "$OUT/node0.log"; do sleep 0.05; done
kill -9 $NODE1; { wait $NODE1; } 2>/dev/null || true
echo "node 1 killed after step $(grep -o 'step  *[0-9]*/' "$OUT/node0.log" | tail -1 | tr -dc 0-9)"
until grep -q "round 1:" "$OUT/node0.log"; do sleep 0.05; done
$NODE --node-rank 1 -- $JOB > "$OUT/node1-back.log" 2>&1
wait $NODE0
grep -h "^meshrun: \(round\|the ranks\|rank\)" "$OUT/node0.log" | cut -c1-160
grep -h "runs dp\|resumed from" "$OUT/node0.log" | sed 's/^\[rank0\]: //'
/usr/bin/python3 - "$OUT/uninterrupted.log" "$OUT/node0.log" <<'PY'
import re, sys
def losses(path):
    out, rnd = {}, 0
    for line in open(path):
        if re.match(r"meshrun: round (\d+)", line):
            rnd = int(re.match(r"meshrun: round (\d+)", line).group(1))
        m = re.search(r"\bstep\s+(\d+)/\d+ \| loss\s+([-\d.]+)", line)
        if m:
            out[int(m.group(1))] = (float(m.group(2)), rnd)
    return out
ref, el = losses(sys.argv[1]), losses(sys.argv[2])
print(f"\n{'step':>4} {'one process':>12} {'elastic':>9} {'round':>5}")
for s in sorted(el):
    if s % 4 == 0 or s < 3:
        print(f"{s:>4} {ref[s][0]:>12.4f} {el[s][0]:>9.4f} {el[s][1]:>5}")
worst = max(abs(el[s][0] - ref[s][0]) for s in el)
print(f"\n{len(el)} steps; largest difference of the printed losses: {worst:.4f}")
PY
