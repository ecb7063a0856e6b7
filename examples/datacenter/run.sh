#!/usr/bin/env bash
# The article's datacenter example on one machine: two meshrun "nodes" on
# loopback (MESHTRAIN_HOST_ID makes them two hosts) form one job of 8 ranks;
# the pipeline runs inside each node (pp 2) and data parallelism spans both
# (dp 4: two replicas per node). tp is innermost, then pp, then dp, so a
# node's 4 ranks are two whole pipelines; only the dp traffic crosses the link
# between the datacenters.
#
# Trained twice, side by side: on Gloo everywhere (every byte over TCP, the
# gradients in one flat ring over the 4 replicas), then on the default backend
# (shared memory inside each node; the dp all-reduce hierarchical: reduce-
# scatter inside the node, each slice across, all-gather inside). The table
# shows the per-axis and per-link traffic of both.
#   examples/datacenter/run.sh      (after scripts/setup.sh)
set -euo pipefail
cd "$(dirname "$0")/../.."
PORT=${PORT:-29617}
OUT=${OUT:-build/datacenter}; mkdir -p "$OUT"
ARGS="--model gpt --layers 4 --dp 4 --pp 2 --schedule 1f1b --microbatches 4 --global-batch 32 --steps 20 --log-every 10"
COMMON="--nnodes 2 --nproc-per-node 4 --master-addr 127.0.0.1 --master-port $PORT --threads-per-rank 1"
for backend in gloo auto; do
  echo "== --backend $backend"
  MESHTRAIN_HOST_ID=datacenter1 build/bin/meshrun $COMMON --node-rank 1 -- \
    build/bin/meshtrain $ARGS --backend $backend --metrics-out "$OUT/$backend.json" > "$OUT/node1_$backend.log" 2>&1 &
  NODE1=$!
  MESHTRAIN_HOST_ID=datacenter0 build/bin/meshrun $COMMON --node-rank 0 -- \
    build/bin/meshtrain $ARGS --backend $backend --metrics-out "$OUT/$backend.json" | grep -E "backend|step +20/"
  wait $NODE1
done
/usr/bin/python3 - "$OUT/gloo.json" "$OUT/auto.json" <<'PY'
import json, sys
runs = [json.load(open(p)) for p in sys.argv[1:]]
def axis(r, a, key):
    t = r["traffic_by_axis"].get(a, {}).get("total", {})
    return t.get(key, 0)
print("\nPer rank and step: bytes sent (from --metrics-out); 'across' = to the other datacenter.")
print(f"{'rank':>4} {'node':>4} {'stage':>5} | {'pp':>9} {'dp':>11} {'dp across':>11} | {'pp':>9} {'dp':>11} {'dp across':>11}")
print(f"{'':>16} | {'--backend gloo (all TCP)':^33} | {'--backend auto (shm + hierarchical)':^35}")
for g, a in zip(runs[0]["ranks"], runs[1]["ranks"]):
    r = g["rank"]
    cells = [f"{axis(x, 'pp', 'bytes_sent'):>9,.0f} {axis(x, 'dp', 'bytes_sent'):>11,.0f} "
             f"{x['traffic_by_axis']['dp']['inter_host']['bytes_sent']:>11,.0f}" for x in (g, a)]
    print(f"{r:>4} {r // 4:>4} {r % 2:>5} | {cells[0]} | {cells[1]}")
for name, m in zip(["gloo", "auto"], runs):
    across = sum(x["traffic_by_axis"]["dp"]["inter_host"]["bytes_sent"] for x in m["ranks"])
    print(f"--backend {name}: {m['step_time_s'] * 1000:.0f} ms/step, {across:,.0f} bytes/step sent between the datacenters")
PY
