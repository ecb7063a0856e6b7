#!/usr/bin/env bash
# The main job: install what is missing, build, and run on local ranks.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
echo
echo "== the article's toy example: one tensor from rank 0 to rank 1"
build/bin/meshrun --nproc-per-node 2 --master-port 0 -- build/bin/send_recv
echo
echo "== every collective on 4 local ranks"
build/bin/meshrun --nproc-per-node 4 --master-port 0 -- build/bin/collectives
