#!/usr/bin/python3
"""Two builds side by side (bench/collectives/ab.sh): for every meshtrain
backend, world size, operation and size, the median time per op of the base
build and of the new one, new / base (<1: the new build is faster), each run's
pair of times (they ran back to back), and OpenMPI's time over the same
transport (shared memory for shm, TCP for gloo). Standard library only."""
import argparse, collections, json, os, statistics, sys

PEER = {"meshtrain shm": "OpenMPI (shared memory)", "meshtrain gloo": "OpenMPI (TCP)"}


def human(b):
    return f"{b // 2**20} MiB" if b >= 2**20 else f"{b // 1024} KiB"


def load(directory):
    times = collections.defaultdict(dict)  # (world, impl, op, bytes) -> {run: sec}
    for name in sorted(os.listdir(directory)):
        if not name.endswith(".json"):
            continue
        run = int(name.rsplit("_", 1)[1].split(".")[0])
        d = json.load(open(os.path.join(directory, name)))
        for r in d["rows"]:
            times[(d["world_size"], d["impl"], r["op"], r["bytes"])][run] = r["sec_per_op"]
    return times


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("base")
    p.add_argument("new")
    a = p.parse_args()
    base, new = load(a.base), load(a.new)
    print("| ranks | backend | op | size | base us | new us | new / base | runs (base/new) | OpenMPI us |")
    print("|---|---|---|---|---:|---:|---:|---|---:|")
    ratios = []
    for key in sorted(k for k in new if k[1] in PEER and k in base):
        w, impl, op, b = key
        runs = sorted(set(base[key]) & set(new[key]))
        if not runs:
            continue
        mb, mn = statistics.median(base[key][r] for r in runs), statistics.median(new[key][r] for r in runs)
        peer = new.get((w, PEER[impl], op, b), {})
        mp = f"{statistics.median(peer.values()) * 1e6:,.1f}" if peer else "n/a"
        pairs = " ".join(f"{base[key][r] * 1e6:.0f}/{new[key][r] * 1e6:.0f}" for r in runs)
        ratios.append(mn / mb)
        print(f"| {w} | {impl.split()[-1]} | {op} | {human(b)} | {mb * 1e6:,.1f} | {mn * 1e6:,.1f} | {mn / mb:.2f} | "
              f"{pairs} | {mp} |")
    if ratios:
        print(f"\nnew / base over {len(ratios)} cells: median {statistics.median(ratios):.3f}, "
              f"min {min(ratios):.2f}, max {max(ratios):.2f}")


if __name__ == "__main__":
    sys.exit(main())
