#!/usr/bin/env bash
# Collectives over TCP loopback, side by side in one run (issue 32, item 2):
# meshtrain's Gloo backend on its TCP links, OpenMPI's own collectives over its
# TCP transport (bench_mpi_peer, btl tcp), and PyTorch's Gloo (torch_peer.py),
# interleaved run by run. Prints the tables (tcp_report.py) and, with DOC=1,
# writes them into docs/BENCHMARKS.md.
#   bench/collectives/tcp.sh     (RUNS=3 SIZES=4K,64K,1M,16M,64M WORLDS="2 4" TARGET_S=0.3)
set -euo pipefail
cd "$(dirname "$0")/../.."
cmake --build build --target benchmarks > /dev/null  # out of the default build
RUNS=${RUNS:-3}; SIZES=${SIZES:-4K,64K,1M,16M,64M}; WORLDS=${WORLDS:-2 4}; TARGET_S=${TARGET_S:-0.3}
OUT=${OUT:-build/bench/collectives_tcp}; mkdir -p "$OUT"; rm -f "$OUT"/*.json
source bench/collectives/peers.sh
require_torch_peer
ARGS="--sizes $SIZES --target-s $TARGET_S"
gloo() {  # gloo N RUN
  MESHTRAIN_BACKEND=gloo build/bin/meshrun --nproc-per-node "$1" --master-port 0 \
    --threads-per-rank 1 -- build/bin/bench_collectives $ARGS --out "$OUT/mt_gloo_links_w$1_$2.json" > /dev/null
}
for i in $(seq 1 "$RUNS"); do
  for n in $WORLDS; do
    gloo "$n" "$i"
    $MPIRUN -np "$n" --mca btl self,tcp --mca btl_tcp_if_include lo build/bin/bench_mpi_peer $ARGS \
      --out "$OUT/ompi_tcp_w${n}_$i.json" > /dev/null
    /usr/bin/python3 bench/collectives/torch_peer.py --world-size "$n" $ARGS --out "$OUT/torch_w${n}_$i.json" > /dev/null
  done
done
DOC_ARGS=(); [ "${DOC:-0}" = 1 ] && DOC_ARGS=(--doc docs/BENCHMARKS.md)
/usr/bin/python3 bench/collectives/tcp_report.py "$OUT"/*.json "${DOC_ARGS[@]}" \
  --header "Measured $(date -u +%Y-%m-%d) with bench/collectives/tcp.sh (RUNS=$RUNS) on $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) cores."
