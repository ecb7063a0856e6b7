#!/usr/bin/env bash
# Collectives, side by side in one run, on 2 and 4 ranks of this machine:
# meshtrain on each backend (shared memory, Gloo, MPI under mpirun), OpenMPI's
# own collectives over shared memory and over TCP loopback (bench_mpi_peer),
# and PyTorch's Gloo (torch_peer.py), interleaved run by run so that machine
# noise hits all alike. Writes the tables and the issue's floors to docs/BENCHMARKS.md.
#   bench/collectives/run.sh      (RUNS=3 SIZES=4K,64K,1M,16M,64M WORLDS="2 4" TARGET_S=0.3)
#
# Every implementation runs with the same allocator setting: glibc otherwise
# hands large freed blocks back to the kernel and page-faults them in again on
# the next call (~15 us a page in this VM), which costs OpenMPI's reductions,
# whose scratch buffers are allocated per call, up to 10x at 64 MiB.
set -euo pipefail
cd "$(dirname "$0")/../.."
cmake --build build --target benchmarks > /dev/null  # out of the default build
RUNS=${RUNS:-3}; SIZES=${SIZES:-4K,64K,1M,16M,64M}; WORLDS=${WORLDS:-2 4}; TARGET_S=${TARGET_S:-0.3}
OUT=${OUT:-build/bench/collectives}; mkdir -p "$OUT"; rm -f "$OUT"/*.json
source bench/collectives/peers.sh
require_torch_peer
ARGS="--sizes $SIZES --target-s $TARGET_S"
for i in $(seq 1 "$RUNS"); do
  for n in $WORLDS; do
    run_meshtrain "$n" "$i" $ARGS
    $MPIRUN -np "$n" --mca btl self,vader -x OMP_NUM_THREADS=1 -x MESHTRAIN_BACKEND=mpi \
      build/bin/bench_collectives $ARGS --out "$OUT/mt_mpi_w${n}_$i.json" > /dev/null
    run_openmpi "$n" "$i" $ARGS
    /usr/bin/python3 bench/collectives/torch_peer.py --world-size "$n" $ARGS --out "$OUT/torch_w${n}_$i.json" > /dev/null
  done
done
/usr/bin/python3 bench/collectives/report.py "$OUT"/*.json --doc docs/BENCHMARKS.md \
  --header "Measured $(date -u +%Y-%m-%d) with bench/collectives/run.sh (RUNS=$RUNS)."
