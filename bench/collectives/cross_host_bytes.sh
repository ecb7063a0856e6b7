#!/usr/bin/env bash
# The bytes that cross hosts per DDP step, flat gloo against hierarchical, as
# the kernel counts them on the link between two test hosts (network
# namespaces; needs root), meshtrain's own count and the closed forms: runs the
# test that asserts them (Cluster.CrossHostBytesMatchTheFormulas) and puts its
# table into docs/comm.md between the cross-host-bytes markers.
#   bench/collectives/cross_host_bytes.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
table=$(mktemp)
MESHTRAIN_BYTES_TABLE="$table" build/bin/cluster_full_tests --gtest_filter=Cluster.CrossHostBytesMatchTheFormulas |
  grep -E "OK|FAILED|Failure|Expected|Which is|actual" || true
[ -s "$table" ] || { echo "the test wrote no table" >&2; exit 1; }
{
  echo "Measured $(date -u +%Y-%m-%d) with bench/collectives/cross_host_bytes.sh (DDP of the tiny GPT, 4 layers x 32 hidden, on 2 hosts x 2 ranks; per step: 10 steps less 2)."
  echo
  cat "$table"
} > "$table.block"
/usr/bin/python3 bench/section.py docs/comm.md cross-host-bytes "What crosses hosts, measured" "$table.block"
rm -f "$table" "$table.block"
echo "docs/comm.md updated"
