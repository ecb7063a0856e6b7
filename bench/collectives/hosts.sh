#!/usr/bin/env bash
# Collectives across hosts, side by side in one run: 2 test hosts of 2 ranks
# (network namespaces, tests/cluster/hosts.sh; needs root), their links shaped
# to each RATE in turn (tc tbf), and on each:
#   meshtrain hierarchical   meshrun, 2 nodes (shared memory inside a host, Gloo between)
#   meshtrain gloo           meshrun, 2 nodes, MESHTRAIN_BACKEND=gloo (flat)
#   meshtrain mpi            mpirun (tests/cluster/mpi_agent.sh in ssh's place), the MPI backend
#   OpenMPI                  mpirun, bench_mpi_peer: OpenMPI's own collectives
# mpirun's transports: TCP between the hosts, shared memory (vader) inside.
# Then, links unshaped, the bytes one op puts on the link between the hosts
# (host 0's veth counters, both ways, TCP/IP headers included): each op and
# size run alone for 14 calls (--target-s 0: 1 + 5 warm-up + 3 estimate + 5),
# less a run of a 16-byte all_reduce for what starting the job costs (BYTES=1;
# 4 launches per op and size, each ~30 s on a loaded 2-core machine).
# Then (TRAIN=1, the default) a training step on each rate: DDP (--dp 4) of a
# GPT of 6.6M parameters (26 MB of gradients) under meshrun (hierarchical,
# flat gloo) and mpirun (the MPI backend: OpenMPI's collectives), the mean
# step after the first, and the bytes one step puts on the link (host 0's
# veth, a job of 8 steps less one of 3, on the first rate).
#   bench/collectives/hosts.sh     (RATES="1gbit 200mbit" SIZES=64K,1M,16M OPS=all_reduce,all_gather,reduce_scatter,broadcast TARGET_S=0.1 BYTES=0 TRAIN=1)
# Writes the table to docs/BENCHMARKS.md (section "Collectives across hosts").
set -euo pipefail
cd "$(dirname "$0")/../.."
RATES=${RATES:-1gbit 200mbit}; SIZES=${SIZES:-64K,1M,16M}; OPS=${OPS:-all_reduce,all_gather,reduce_scatter,broadcast}
TARGET_S=${TARGET_S:-0.1} BYTES=${BYTES:-0} TRAIN=${TRAIN:-1}; OUT=${OUT:-build/bench/collectives_hosts}
mkdir -p "$OUT"; rm -f "$OUT"/*.json "$OUT"/*.bytes; OUT=$(cd "$OUT" && pwd)
HOSTS=$PWD/tests/cluster/hosts.sh BIN=${BIN:-$PWD/build/bin}
NAME=mb$(($$ % 10000)) NET=10.$((200 + $$ % 50)).$(($$ / 50 % 250))
trap '"$HOSTS" down "$NAME" 2' EXIT
"$HOSTS" up "$NAME" 2 "$NET"
openssl rand -hex 32 > "$OUT/token"
printf '%s.1 slots=2\n%s.2 slots=2\n' "$NET" "$NET" > "$OUT/hostfile"
export MALLOC_TRIM_THRESHOLD_=${MALLOC_TRIM_THRESHOLD_:-4294967296} MALLOC_TOP_PAD_=${MALLOC_TOP_PAD_:-1073741824}
port=29700

# meshrun on both hosts, 2 ranks each; $1: MESHTRAIN_BACKEND (auto: hierarchical), the rest: the program's flags.
meshrun_job() {
  local backend=$1; shift; port=$((port + 1))
  for node in 1 0; do
    MESHTRAIN_BACKEND=$backend "$HOSTS" run "$NAME" "$node" "$BIN/meshrun" --nnodes 2 --node-rank "$node" \
      --nproc-per-node 2 --master-addr "$NET.1" --master-port "$port" --rdzv-token-file "$OUT/token" \
      --threads-per-rank 1 --quiet -- "$@" >> "$OUT/log" 2>&1 &
  done
  wait
}
# mpirun on host 0 over both hosts, 2 ranks each.
mpirun_job() {
  "$HOSTS" run "$NAME" 0 mpirun --allow-run-as-root --hostfile "$OUT/hostfile" -np 4 --bind-to none \
    --mca plm_rsh_agent "$PWD/tests/cluster/mpi_agent.sh" --mca btl tcp,vader,self --mca mpi_yield_when_idle 1 \
    --mca btl_tcp_if_include "$NET.0/24" --mca oob_tcp_if_include "$NET.0/24" \
    -x MALLOC_TRIM_THRESHOLD_ -x MALLOC_TOP_PAD_ -x OMP_NUM_THREADS=1 "$@" >> "$OUT/log" 2>&1
}
# $1: a file name tag, the rest: --ops/--sizes/--target-s/--out flags for every implementation.
all_impls() {
  local tag=$1; shift
  echo "$(date +%T) $tag" >> "$OUT/log"
  meshrun_job auto "$BIN/bench_collectives" "$@" --out "$OUT/hier_$tag.json"
  meshrun_job gloo "$BIN/bench_collectives" "$@" --out "$OUT/gloo_$tag.json"
  mpirun_job -x MESHTRAIN_BACKEND=mpi "$BIN/bench_collectives" "$@" --out "$OUT/mpi_$tag.json"
  mpirun_job "$BIN/bench_mpi_peer" --impl OpenMPI "$@" --out "$OUT/ompi_$tag.json"
}
link_bytes() {
  local s=/sys/class/net/${NAME}h0/statistics
  ip netns exec "$NAME"0 sh -c "echo \$((\$(cat $s/rx_bytes) + \$(cat $s/tx_bytes)))"
}

for rate in $RATES; do
  "$HOSTS" shape "$NAME" 0 "$rate"; "$HOSTS" shape "$NAME" 1 "$rate"
  all_impls "$rate" --ops "$OPS" --sizes "$SIZES" --target-s "$TARGET_S"
done
# Bytes: unshaped links, every op and size alone.
ops=; if [ "$BYTES" = 1 ]; then
  ip netns exec "$NAME"sw tc qdisc del dev "${NAME}s0" root; ip netns exec "$NAME"sw tc qdisc del dev "${NAME}s1" root
  ops="start ${OPS//,/ }"
fi
for op in $ops; do
  for size in ${SIZES//,/ }; do
    [ "$op" = start ] && { [ "$size" = "${SIZES%%,*}" ] || continue; }
    flags="--ops ${op/start/all_reduce} --sizes $([ "$op" = start ] && echo 16 || echo "$size") --target-s 0"
    before=$(link_bytes)
    meshrun_job auto "$BIN/bench_collectives" $flags --out /dev/null; after=$(link_bytes)
    echo "hier $op $size $((after - before))" >> "$OUT/link.bytes"; before=$after
    meshrun_job gloo "$BIN/bench_collectives" $flags --out /dev/null; after=$(link_bytes)
    echo "gloo $op $size $((after - before))" >> "$OUT/link.bytes"; before=$after
    mpirun_job -x MESHTRAIN_BACKEND=mpi "$BIN/bench_collectives" $flags --out /dev/null; after=$(link_bytes)
    echo "mpi $op $size $((after - before))" >> "$OUT/link.bytes"; before=$after
    mpirun_job "$BIN/bench_mpi_peer" --impl OpenMPI $flags --out /dev/null; after=$(link_bytes)
    echo "ompi $op $size $((after - before))" >> "$OUT/link.bytes"
  done
done
# Training steps: DDP of a GPT across the hosts, each backend, each rate.
GPT="--model gpt --layers 8 --hidden 256 --heads 8 --vocab 1024 --seq-len 128 --global-batch 16 --micro-batch 4"
GPT="$GPT --dp 4 --precision fp32 --log-every 1000 --eval-problems 0"
first_rate=${RATES%% *}
for rate in $([ "$TRAIN" = 1 ] && echo "$RATES"); do
  "$HOSTS" shape "$NAME" 0 "$rate"; "$HOSTS" shape "$NAME" 1 "$rate"
  for impl in hier gloo mpi; do
    for steps in $([ "$rate" = "$first_rate" ] && echo 3) 8; do
      metrics="$OUT/train_${impl}_${rate}_${steps}.json" before=$(link_bytes)
      case $impl in
        hier) meshrun_job auto "$BIN/meshtrain" $GPT --steps "$steps" --metrics-out "$metrics" ;;
        gloo) meshrun_job gloo "$BIN/meshtrain" $GPT --steps "$steps" --metrics-out "$metrics" ;;
        mpi) mpirun_job "$BIN/meshtrain" $GPT --steps "$steps" --metrics-out "$metrics" ;;
      esac
      echo "$impl $rate $steps $(($(link_bytes) - before))" >> "$OUT/train.bytes"
    done
  done
done
/usr/bin/python3 bench/collectives/hosts_report.py "$OUT" --rates "$RATES" --doc docs/BENCHMARKS.md \
  --header "Measured $(date -u +%Y-%m-%d) with bench/collectives/hosts.sh (TARGET_S=$TARGET_S, one run)."
