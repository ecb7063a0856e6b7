#!/usr/bin/env bash
# The article's datacenter example on one machine: two meshrun "nodes" on
# loopback form one job of 4 ranks; the pipeline runs inside each node (pp 2)
# and data parallelism across the nodes (dp 2). tp is innermost, then pp, then
# dp, so a node's ranks are one pipeline; only the dp traffic would cross the
# link between the datacenters. The per-axis traffic table shows it.
#   examples/datacenter/run.sh      (after scripts/setup.sh)
set -euo pipefail
cd "$(dirname "$0")/../.."
PORT=${PORT:-29617}
OUT=${OUT:-build/datacenter}; mkdir -p "$OUT"
ARGS="--model gpt --layers 4 --dp 2 --pp 2 --schedule 1f1b --microbatches 4 --steps 20 --log-every 5 --metrics-out $OUT/metrics.json"
COMMON="--nnodes 2 --nproc-per-node 2 --master-addr 127.0.0.1 --master-port $PORT"
build/bin/meshrun $COMMON --node-rank 1 -- build/bin/meshtrain $ARGS > "$OUT/node1.log" 2>&1 &
NODE1=$!
build/bin/meshrun $COMMON --node-rank 0 -- build/bin/meshtrain $ARGS
wait $NODE1
/usr/bin/python3 - "$OUT/metrics.json" <<'PY'
import json, sys
m = json.load(open(sys.argv[1]))
print("\nPer-axis traffic per step (bytes sent + received), from --metrics-out:")
print(f"{'rank':>4} {'node':>4} {'stage':>5} {'pp (inside the node)':>22} {'dp (across the nodes)':>23}")
for r in m["ranks"]:
    t = r["traffic_by_axis"]
    b = lambda a: t[a]["total"]["bytes_sent"] + t[a]["total"]["bytes_received"] if a in t else 0
    print(f"{r['rank']:>4} {r['rank'] // 2:>4} {r['rank'] % 2:>5} {b('pp'):>22,.0f} {b('dp'):>23,.0f}")
print("Only the dp column would travel between the datacenters: the gradients, once per step.")
PY
