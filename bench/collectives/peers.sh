# Sourced by bench/collectives/run.sh and all_to_all.sh: the allocator
# settings every implementation runs with (glibc otherwise hands large freed
# blocks back to the kernel and page-faults them in again on the next call)
# and the runs the two scripts share. Each writes "$OUT/<impl>_w<n>_<i>.json".
export MALLOC_TRIM_THRESHOLD_=${MALLOC_TRIM_THRESHOLD_:-4294967296} MALLOC_TOP_PAD_=${MALLOC_TOP_PAD_:-1073741824}
MPIRUN="mpirun --allow-run-as-root --oversubscribe --bind-to none -x MALLOC_TRIM_THRESHOLD_ -x MALLOC_TOP_PAD_"

# meshtrain's shared-memory and Gloo backends:  run_meshtrain N RUN ARGS...
run_meshtrain() {
  local n=$1 i=$2 backend; shift 2
  for backend in shm gloo; do
    MESHTRAIN_BACKEND=$backend build/bin/meshrun --nproc-per-node "$n" --master-port 0 --threads-per-rank 1 -- \
      build/bin/bench_collectives "$@" --out "$OUT/mt_${backend}_w${n}_$i.json" > /dev/null
  done
}

# OpenMPI's own collectives over shared memory (vader) and TCP loopback:  run_openmpi N RUN ARGS...
run_openmpi() {
  local n=$1 i=$2; shift 2
  $MPIRUN -np "$n" --mca btl self,vader build/bin/bench_mpi_peer "$@" --out "$OUT/ompi_shm_w${n}_$i.json" > /dev/null
  $MPIRUN -np "$n" --mca btl self,tcp --mca btl_tcp_if_include lo build/bin/bench_mpi_peer "$@" \
    --out "$OUT/ompi_tcp_w${n}_$i.json" > /dev/null
}

# PyTorch's Gloo, the peer of run.sh and tcp.sh: Debian's python3-torch, which
# scripts/setup.sh installs with --with-peers. Said at once, not after the other runs.
require_torch_peer() {
  /usr/bin/python3 -c 'import torch' 2>/dev/null && return
  echo "$0: the PyTorch peer needs Debian's python3-torch: run scripts/setup.sh --with-peers" >&2
  exit 1
}
