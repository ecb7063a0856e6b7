#!/usr/bin/env bash
# Two builds of libmeshtrain side by side (before and after a change), run by
# run interleaved with OpenMPI's and PyTorch's collectives: this host drifts
# ±15% within minutes, so only runs that alternate tell two builds apart.
#   BASE=/tmp/base bench/collectives/ab.sh   (RUNS=5 SIZES=4K,64K,1M,16M,64M WORLDS="2 4" TARGET_S=0.3)
# BASE holds the other build's bin/ and lib/ (cp -a build/bin build/lib /tmp/base);
# its programs load its own libmeshtrain (LD_LIBRARY_PATH comes before their RUNPATH).
# Each run measures meshtrain's shm and gloo backends of both builds (which goes
# first alternates), OpenMPI over shared memory and over TCP, and PyTorch's Gloo.
# Writes $OUT/{base,new}/*.json (the peers' files in both), prints each build's
# tables with report.py (shared-memory floors) and tcp_report.py (TCP floors),
# then the two builds side by side (ab_report.py).
set -euo pipefail
cd "$(dirname "$0")/../.."
: "${BASE:?set BASE to a directory holding the other build's bin/ and lib/}"
cmake --build build --target benchmarks meshrun > /dev/null
RUNS=${RUNS:-5}; SIZES=${SIZES:-4K,64K,1M,16M,64M}; WORLDS=${WORLDS:-2 4}; TARGET_S=${TARGET_S:-0.3}
OUT=${OUT:-build/bench/ab}; rm -rf "$OUT"; mkdir -p "$OUT/base" "$OUT/new"
source bench/collectives/peers.sh
require_torch_peer
ARGS="--sizes $SIZES --target-s $TARGET_S"
NEW_BIN=build/bin NEW_LIB=build/lib

one() {  # one SIDE N RUN BACKEND: one build's bench_collectives on one backend
  local bin=$NEW_BIN lib=$NEW_LIB name
  [ "$1" = base ] && bin=$BASE/bin lib=$BASE/lib
  name=mt_$4; [ "$4" = gloo ] && name=mt_gloo_links  # tcp_report.py's name for the TCP links
  MESHTRAIN_BACKEND=$4 LD_LIBRARY_PATH=$lib "$bin/meshrun" --nproc-per-node "$2" --master-port 0 \
    --threads-per-rank 1 -- "$bin/bench_collectives" $ARGS --out "$OUT/$1/${name}_w$2_$3.json" > /dev/null
}

for i in $(seq 1 "$RUNS"); do
  for n in $WORLDS; do
    for backend in shm gloo; do
      if (( i % 2 )); then one base "$n" "$i" $backend; one new "$n" "$i" $backend
      else one new "$n" "$i" $backend; one base "$n" "$i" $backend; fi
    done
    OUT=$OUT/new run_openmpi "$n" "$i" $ARGS
    /usr/bin/python3 bench/collectives/torch_peer.py --world-size "$n" $ARGS --out "$OUT/new/torch_w${n}_$i.json" > /dev/null
    cp "$OUT"/new/ompi_*_w"${n}_$i".json "$OUT/new/torch_w${n}_$i.json" "$OUT/base/"
  done
done
for side in base new; do
  echo "## $side"
  /usr/bin/python3 bench/collectives/report.py "$OUT/$side"/*.json | grep -v '^$'
  /usr/bin/python3 bench/collectives/tcp_report.py "$OUT/$side"/*.json | grep -v '^$'
done
/usr/bin/python3 bench/collectives/ab_report.py "$OUT/base" "$OUT/new"
