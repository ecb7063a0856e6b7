#!/usr/bin/env bash
# All-to-all side by side in one run (issue 29's dispatch/combine transport):
# meshtrain's Communicator::all_to_all (variable sizes) on shared memory and
# Gloo against OpenMPI's MPI_Alltoallv over shared memory (vader) and TCP
# loopback, 2 and 4 ranks, the protocol of bench_collectives; best of RUNS.
#   bench/collectives/all_to_all.sh     (RUNS=2 SIZES=4K,64K,1M,16M,64M WORLDS="2 4")
set -euo pipefail
cd "$(dirname "$0")/../.."
RUNS=${RUNS:-2}; SIZES=${SIZES:-4K,64K,1M,16M,64M}; WORLDS=${WORLDS:-2 4}; TARGET_S=${TARGET_S:-0.3}
OUT=${OUT:-build/bench/all_to_all}; mkdir -p "$OUT"; rm -f "$OUT"/*.json
make -C build -j2 bench_collectives bench_mpi_peer > /dev/null
source bench/collectives/peers.sh
ARGS="--ops all_to_all --sizes $SIZES --target-s $TARGET_S"
for i in $(seq 1 "$RUNS"); do
  for n in $WORLDS; do
    run_meshtrain "$n" "$i" $ARGS
    run_openmpi "$n" "$i" $ARGS
  done
done
/usr/bin/python3 - "$OUT" "$WORLDS" "$RUNS" > "$OUT/section.md" <<'PY'
import glob, json, os, sys, datetime
out, worlds, runs = sys.argv[1], sys.argv[2].split(), sys.argv[3]
def best(prefix, n):
    t = {}
    for f in glob.glob(os.path.join(out, f"{prefix}_w{n}_*.json")):
        for row in json.load(open(f))["rows"]:
            t[row["bytes"]] = min(t.get(row["bytes"], 1e9), row["sec_per_op"])
    return t
def size(b): return f"{b >> 20} MiB" if b >= 1 << 20 else f"{b >> 10} KiB"
print(f"Measured {datetime.date.today()} with bench/collectives/all_to_all.sh (best of {runs}); time per call in us "
      "(slowest rank); S = one rank's send buffer, S/n to each rank; ratio = OpenMPI's time / meshtrain's (>1: meshtrain faster).\n")
print("| ranks | S | meshtrain shm | OpenMPI shm (Alltoallv) | ratio | meshtrain Gloo | OpenMPI TCP (Alltoallv) | ratio |")
print("|---:|---:|---:|---:|---:|---:|---:|---:|")
for n in worlds:
    ms, os_, mg, ot = best("mt_shm", n), best("ompi_shm", n), best("mt_gloo", n), best("ompi_tcp", n)
    for b in sorted(ms):
        print(f"| {n} | {size(b)} | {ms[b]*1e6:,.1f} | {os_[b]*1e6:,.1f} | {os_[b]/ms[b]:.2f} | "
              f"{mg[b]*1e6:,.1f} | {ot[b]*1e6:,.1f} | {ot[b]/mg[b]:.2f} |")
PY
cat "$OUT/section.md"
/usr/bin/python3 bench/section.py docs/BENCHMARKS.md all-to-all "All-to-all against MPI_Alltoallv" "$OUT/section.md"
