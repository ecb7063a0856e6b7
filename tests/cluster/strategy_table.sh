#!/usr/bin/env bash
# Every strategy across test hosts against one process, as a table: runs the
# whole product of ClusterProduct/AcrossHosts (cluster_full_tests; network
# namespaces, needs root) with MESHTRAIN_STRATEGY_TABLE and puts the rows into
# docs/launch.md between the strategies-across-hosts markers.
#   tests/cluster/strategy_table.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
rows=$(mktemp)
MESHTRAIN_STRATEGY_TABLE="$rows" build/bin/cluster_full_tests --gtest_filter='ClusterProduct/AcrossHosts.*' |
  grep -E "^\[  (PASSED|FAILED) |OK \]|Failure" || true
[ -s "$rows" ] || { echo "the test wrote no rows" >&2; exit 1; }
{
  echo "Measured $(date -u +%Y-%m-%d) with tests/cluster/strategy_table.sh: the tiny GPT (4 layers x 32 hidden, 53,440"
  echo "parameters), global batch 24, 8 steps, against one process; differences are the largest over the 8 steps,"
  echo "relative; bytes are what all ranks sent to other hosts per step (meshtrain's count; \"all\" adds the"
  echo "verification rounds), by mesh axis."
  echo
  echo "| strategy | flags | hosts x ranks | backend | loss diff | grad-norm diff | dp bytes | pp bytes | tp bytes | all bytes | job s |"
  echo "|---|---|---|---|---|---|---|---|---|---|---|"
  cat "$rows"
} > "$rows.block"
/usr/bin/python3 bench/section.py docs/launch.md strategies-across-hosts "Every strategy across hosts" "$rows.block"
rm -f "$rows" "$rows.block"
echo "docs/launch.md updated"
