#!/usr/bin/env bash
# The fault-injection campaign (bench/faults/campaign.py says what each fault
# and column is): TRIALS trials per fault on 4 ranks, the table into
# docs/BENCHMARKS.md. A benchmark, not a test: it takes ~30 minutes at 50 trials.
#   bench/faults/run.sh            (TRIALS=50; FAULTS=kill-rank,stop-rank,elastic,... for a subset;
#                                   FAULTS=desync-flag,changed-data TRIALS=28: the refusal campaign;
#                                   FAULTS=stranger-frames,flag-mismatch TRIALS=30: the nodes meeting)
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-build/bench/faults}; rm -rf "$OUT"; mkdir -p "$OUT"
/usr/bin/python3 bench/faults/campaign.py "$OUT" | tee "$OUT/trials.log"
/usr/bin/python3 bench/faults/report.py "$OUT" --doc docs/BENCHMARKS.md \
  --header "Measured $(date -u +%Y-%m-%d) with bench/faults/run.sh (TRIALS=${TRIALS:-50})."
