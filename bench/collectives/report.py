#!/usr/bin/python3
"""Renders collective results (JSON files from bench_collectives, bench_mpi_peer
and torch_peer.py; several runs and world sizes) as markdown tables, one per
world size: time per op and bus bandwidth for every implementation (medians
over runs), the ratios the issue's floors are stated in, and a list of those
floors met or missed. Replaces the collectives section of docs/BENCHMARKS.md.
Standard library only."""
import argparse, collections, json, statistics, sys

BUS = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
       "reduce_scatter": lambda n: (n - 1) / n, "reduce_scatter (all_reduce+slice)": lambda n: (n - 1) / n,
       "broadcast": lambda n: 1.0}
OPS = ["all_reduce", "all_gather", "reduce_scatter", "broadcast"]
ORDER = ["meshtrain shm", "meshtrain gloo", "meshtrain mpi", "OpenMPI (shared memory)", "OpenMPI (TCP)", "torch"]
MESHTRAIN = ["meshtrain shm", "meshtrain gloo", "meshtrain mpi"]


def human(b):
    return f"{b // 2**20} MiB" if b >= 2**20 else f"{b // 1024} KiB"


def load(files):
    times = collections.defaultdict(list)  # (world, impl, op, bytes) -> [sec]
    unsupported = {}
    for path in files:
        d = json.load(open(path))
        for k, v in d.get("unsupported", {}).items():
            unsupported[f'{d["impl"]}: {k}'] = v
        for r in d["rows"]:
            times[(d["world_size"], d["impl"], r["op"], r["bytes"])].append(r["sec_per_op"])
    return {k: statistics.median(v) for k, v in times.items()}, unsupported, max(len(v) for v in times.values())


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("files", nargs="+")
    p.add_argument("--doc", default=None, help="markdown file whose collectives section is replaced")
    p.add_argument("--header", default="")
    a = p.parse_args()
    med, unsupported, runs = load(a.files)
    worlds = sorted({k[0] for k in med})
    sizes = sorted({k[3] for k in med})

    def t(w, impl, op, b):
        if impl == "torch" and op == "reduce_scatter" and (w, impl, op, b) not in med:
            op = "reduce_scatter (all_reduce+slice)"  # torch 1.13's Gloo has none: its users' workaround
        return med.get((w, impl, op, b))

    def bw(w, impl, op, b):
        x = t(w, impl, op, b)
        return None if x is None else b / x / 1e9 * BUS[op](w)

    lines = [a.header, "",
             "Each cell: time per op in microseconds, bus bandwidth in GB/s in parentheses (nccl-tests "
             f"definition), median of {runs} runs, all measured in the same run on this 2-core machine. "
             "Ratios are of bus bandwidth (>1: the first is faster). torch's reduce_scatter is its users' "
             "workaround, all_reduce then slice (its Gloo group has none). Every implementation runs with "
             "the same glibc allocator setting (see run.sh).", ""]
    floors = []
    for w in worlds:
        impls = [i for i in ORDER if any(k[0] == w and k[1] == i for k in med)]
        lines += [f"### {w} ranks", "",
                  "| op | size | " + " | ".join(impls) + " | shm / OpenMPI shm | slowest meshtrain / torch |",
                  "|---|---|" + "---|" * len(impls) + "---|---|"]
        for op in OPS:
            for b in sizes:
                cells = []
                for impl in impls:
                    x, v = t(w, impl, op, b), bw(w, impl, op, b)
                    cells.append("n/a" if x is None else f"{x * 1e6:,.1f} ({v:.2f})")
                shm, ompi, torch = bw(w, "meshtrain shm", op, b), bw(w, "OpenMPI (shared memory)", op, b), bw(w, "torch", op, b)
                vs_ompi = f"{shm / ompi:.2f}" if shm and ompi else "n/a"
                ours = [bw(w, i, op, b) for i in MESHTRAIN if bw(w, i, op, b)]
                vs_torch = f"{min(ours) / torch:.2f}" if ours and torch else "n/a"
                lines.append(f"| {op} | {human(b)} | " + " | ".join(cells) + f" | {vs_ompi} | {vs_torch} |")
                if w == 2 and shm and ompi:
                    if op == "all_reduce" and b == 4096:
                        floors.append((f"2 ranks, all_reduce 4 KiB: shm latency at most 2x OpenMPI's shared memory",
                                       t(w, "meshtrain shm", op, b) / t(w, "OpenMPI (shared memory)", op, b), "<=", 2.0))
                    if b >= 65536:
                        floors.append((f"2 ranks, {op} {human(b)}: shm bus bandwidth at least 1.0x OpenMPI's", shm / ompi, ">=", 1.0))
                    if op == "all_reduce" and b == 16 << 20:
                        floors.append(("2 ranks, all_reduce 16 MiB: shm at least 1.3x OpenMPI's", shm / ompi, ">=", 1.3))
                if ours and torch:
                    floors.append((f"{w} ranks, {op} {human(b)}: every meshtrain backend at least 1.0x torch",
                                   min(ours) / torch, ">=", 1.0))
        lines.append("")
    met = [f for f in floors if (f[1] <= f[3] if f[2] == "<=" else f[1] >= f[3])]
    lines.append(f"Floors of issue 13 met: {len(met)} of {len(floors)}.")
    for name, value, rel, bound in floors:
        if (name, value, rel, bound) not in met:
            lines.append(f"- missed: {name}: {value:.2f} (needs {rel} {bound})")
    if unsupported:
        lines.append("")
        for k, v in unsupported.items():
            lines.append(f"- not supported by {k}: `{v}`")
    text = "\n".join(lines) + "\n"
    print(text)
    if a.doc:
        begin, end = "<!-- collectives:begin -->", "<!-- collectives:end -->"
        doc = open(a.doc).read()
        block = f"{begin}\n{text}{end}"
        if begin in doc:
            doc = doc[:doc.index(begin)] + block + doc[doc.index(end) + len(end):]
        else:
            doc = doc.rstrip("\n") + "\n\n## Collectives\n\n" + block + "\n"
        open(a.doc, "w").write(doc)


if __name__ == "__main__":
    sys.exit(main())
