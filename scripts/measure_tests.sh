#!/usr/bin/env bash
# Writes tests/test_seconds.txt, each ctest entry's time on this machine, from
# ctest's own record in build/ (Testing/Temporary/CTestCostData.txt: the mean
# time of each entry over the runs it saw). Every entry's time limit derives
# from it (Note [Time limits from measured times] in tests/CMakeLists.txt):
# run the suite on a quiet machine, then this, and commit the table.
#   (cd build && ctest -j2 -LE full) ; scripts/measure_tests.sh
set -euo pipefail
cd "$(dirname "$0")/.."
costs=build/Testing/Temporary/CTestCostData.txt
[ -f "$costs" ] || { echo "measure_tests.sh: no $costs; run ctest in build/ first" >&2; exit 2; }
names=$(mktemp)
(cd build && ctest -N | sed -n 's/^ *Test *#[0-9]*: //p') > "$names"
/usr/bin/python3 - "$costs" tests/test_seconds.txt "$names" <<'PY'
import sys
costs, out, names = sys.argv[1], sys.argv[2], sys.argv[3]
# Entries this run did not measure keep their time (a partial run, or the
# extended set's other thirds); entries ctest no longer has are dropped.
current = {line.strip() for line in open(names) if line.strip()}
seconds = {}
for line in open(out):
    parts = line.split()
    if not line.startswith("#") and len(parts) == 2 and parts[0] in current:
        seconds[parts[0]] = float(parts[1])
for line in open(costs):
    if line.startswith("---"):
        break  # the failed tests follow
    parts = line.split()
    if len(parts) == 3 and float(parts[2]) > 0 and parts[0] in current:
        seconds[parts[0]] = float(parts[2])
with open(out, "w") as f:
    f.write("# ctest entry, mean seconds on a quiet 2-core machine (scripts/measure_tests.sh)\n")
    for n in sorted(seconds):
        f.write(f"{n} {seconds[n]:.1f}\n")
print(f"{out}: {len(seconds)} entries of {len(current)}")
PY
rm -f "$names"
