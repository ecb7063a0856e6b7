#!/usr/bin/env bash
# The main job: install what is missing, build, and train on local ranks.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
echo
echo "== the article's toy example: one tensor from rank 0 to rank 1"
build/bin/meshrun --nproc-per-node 2 --master-port 0 -- build/bin/send_recv
echo
echo "== the GPT learns single-digit addition, DDP on 2 local ranks"
build/bin/meshrun --nproc-per-node 2 --master-port 0 -- build/bin/meshtrain \
  --model gpt --strategy ddp --steps 300 --log-every 25 --eval-problems 200 --plot build/loss.svg
