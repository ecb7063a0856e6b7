#!/usr/bin/env bash
# The whole test suite: install what is missing, build, run ctest.
# Multi-rank tests run one at a time (they spawn their ranks); the rest in parallel.
set -euo pipefail
cd "$(dirname "$0")/.."
# python3-torch: a test opens checkpoints with torch.load; Slurm: the cluster tests' Slurm cluster.
scripts/setup.sh --with-peers --with-slurm
cd build
# No arguments: the default suite (the full equivalence product, the cross-host
# byte count and OpenMPI across test hosts are `-L full`). Arguments replace
# that choice: `scripts/test.sh -L cluster` runs every cluster test.
[ $# -gt 0 ] || set -- -LE full
ctest --output-on-failure -j2 "$@"
