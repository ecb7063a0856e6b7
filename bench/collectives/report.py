#!/usr/bin/python3
"""Renders collective results (JSON files from main.cpp and torch_peer.py, one
or more runs each) as a markdown table of bus bandwidth, medians over runs, with
the ratio meshtrain / torch, and replaces the collectives section of
docs/BENCHMARKS.md. Standard library only."""
import argparse, collections, json, statistics, sys

BUS = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
       "reduce_scatter": lambda n: (n - 1) / n, "reduce_scatter (all_reduce+slice)": lambda n: (n - 1) / n,
       "broadcast": lambda n: 1.0}


def human(b):
    return f"{b // 2**20} MiB" if b >= 2**20 else f"{b // 1024} KiB"


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("files", nargs="+")
    p.add_argument("--doc", default=None, help="markdown file whose collectives section is replaced")
    p.add_argument("--header", default="")
    a = p.parse_args()
    times = collections.defaultdict(list)  # (impl, op, bytes) -> [sec]
    unsupported, impls, world = {}, [], 2
    for path in a.files:
        d = json.load(open(path))
        world = d["world_size"]
        if d["impl"] not in impls:
            impls.append(d["impl"])
        unsupported.update({f'{d["impl"]}: {k}': v for k, v in d.get("unsupported", {}).items()})
        for r in d["rows"]:
            times[(d["impl"], r["op"], r["bytes"])].append(r["sec_per_op"])
    ops = ["all_reduce", "all_gather", "reduce_scatter", "broadcast"]
    sizes = sorted({k[2] for k in times})
    med = {k: statistics.median(v) for k, v in times.items()}
    runs = max(len(v) for v in times.values())

    def bw(impl, op, b):
        t = med.get((impl, op, b))
        return None if t is None else b / t / 1e9 * BUS[op](world)

    lines = [f"{a.header}", "",
             f"Bus bandwidth in GB/s (nccl-tests definition), {world} ranks on one machine, "
             f"median of {runs} runs; time per op in microseconds in parentheses. "
             f"Ratio = meshtrain / torch (>1: meshtrain faster).", "",
             "| op | size | " + " | ".join(impls) + " | ratio |",
             "|---|---|" + "---|" * len(impls) + "---|"]
    for op in ops:
        for b in sizes:
            cells, torch_op = [], op
            for impl in impls:
                o = op
                if impl == "torch" and op == "reduce_scatter" and (impl, op, b) not in med:
                    o = torch_op = "reduce_scatter (all_reduce+slice)"
                v = bw(impl, o, b)
                cells.append("n/a" if v is None else f"{v:.3f} ({med[(impl, o, b)] * 1e6:.0f})")
            mt, th = bw(impls[0], op, b), bw("torch", torch_op, b)
            ratio = f"{mt / th:.2f}" if mt and th else "n/a"
            if torch_op != op:
                ratio += " (torch: all_reduce+slice)"
            lines.append(f"| {op} | {human(b)} | " + " | ".join(cells) + f" | {ratio} |")
    if unsupported:
        lines.append("")
        for k, v in unsupported.items():
            lines.append(f"- not supported by {k}: `{v}`")
    text = "\n".join(lines) + "\n"
    print(text)
    if a.doc:
        begin, end = "<!-- collectives:begin -->", "<!-- collectives:end -->"
        try:
            doc = open(a.doc).read()
        except FileNotFoundError:
            doc = "# Benchmarks\n"
        block = f"{begin}\n{text}{end}"
        if begin in doc:
            doc = doc[:doc.index(begin)] + block + doc[doc.index(end) + len(end):]
        else:
            doc = doc.rstrip("\n") + "\n\n## Collectives\n\n" + block + "\n"
        open(a.doc, "w").write(doc)


if __name__ == "__main__":
    sys.exit(main())
