#!/usr/bin/env bash
# The planner's per-rank model-state prediction against what the trainer holds,
# for every layout of 3 and 4 ranks: runs the test that asserts it (within 5%)
# and puts its table into docs/plan.md between the plan-vs-trainer markers.
#   bench/plan/run.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
table=$(mktemp)
MESHTRAIN_PLAN_TABLE="$table" build/bin/dist_tests --gtest_filter='PlanVsTrainer.*' | grep -E "compared|OK|FAILED"
{
  echo "Measured $(date -u +%Y-%m-%d) with bench/plan/run.sh (the test PlanVsTrainer, tiny GPT: 3 layers x 32 hidden, vocabulary 64, AdamW in fp32 and in bf16-mixed)."
  echo
  cat "$table"
} > "$table.block"
/usr/bin/python3 - "$table.block" docs/plan.md <<'PY'
import sys
block, doc = open(sys.argv[1]).read().strip(), sys.argv[2]
text = open(doc).read()
begin, end = "<!-- plan-vs-trainer:begin -->", "<!-- plan-vs-trainer:end -->"
head, rest = text.split(begin)
_, tail = rest.split(end)
open(doc, "w").write(head + begin + "\n" + block + "\n" + end + tail)
PY
rm -f "$table" "$table.block"
echo "docs/plan.md updated"
