#!/usr/bin/env bash
# The full equivalence matrix (every layout of 2, 4 and 8 ranks x ZeRO 0-3 x
# schedules x sequence parallelism: build/bin/matrix_full_tests, also
# `ctest -L full`), summarized per layout into docs/composition.md: how far
# each layout's losses and weights were from one process's.
#   bench/composition/matrix.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
log=$(mktemp)
build/bin/matrix_full_tests > "$log" 2>&1 || { tail -50 "$log"; exit 1; }
/usr/bin/python3 - "$log" docs/composition.md <<'PY'
import collections, datetime, re, sys
lines = open(sys.argv[1]).read().splitlines()
rows, last = [], None
for l in lines:
    m = re.match(r"equivalence on (\d+) ranks: max \|loss diff\| (\S+), max \|weight diff\| (\S+)", l)
    if m:
        last = m.groups()
    m = re.match(r"\[\s+OK \] Layouts/EquivalenceMatrix.TrainsLikeOneProcess/(\S+)", l)
    if m and last:
        rows.append((m.group(1),) + last)
        last = None
by_layout = collections.defaultdict(list)
for name, world, loss, weight in rows:
    by_layout[(int(world),) + tuple(int(x) for x in re.match(r"dp(\d+)_pp(\d+)_tp(\d+)", name).groups())].append(
        (name, float(loss), float(weight)))
out = [f"Measured {datetime.date.today()} with bench/composition/matrix.sh: {len(rows)} cases, all passed.", "",
       "| ranks | layout | cases (ZeRO x schedule x SP) | max loss difference | max weight difference |",
       "|---|---|---|---|---|"]
for key in sorted(by_layout):
    v = by_layout[key]
    out.append(f"| {key[0]} | dp {key[1]} x pp {key[2]} x tp {key[3]} | {len(v)} | "
               f"{max(x[1] for x in v):.1e} | {max(x[2] for x in v):.1e} |")
out += ["", "Tolerances (tests/dist/equivalence.h): losses within 1e-6 + 2e-6 x |loss|, weights within "
        "2e-5 + 2e-4 x |w| after 3 steps of AdamW at lr 1e-2; a wrong gradient scale misses them by 1e-4 to 1e-2."]
doc = open(sys.argv[2]).read()
begin, end = "<!-- matrix:begin -->", "<!-- matrix:end -->"
head, rest = doc.split(begin)
_, tail = rest.split(end)
open(sys.argv[2], "w").write(head + begin + "\n" + "\n".join(out) + "\n" + end + tail)
print("\n".join(out))
PY
rm -f "$log"
