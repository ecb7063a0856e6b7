#!/usr/bin/python3
"""Tables of bench/collectives/tcp.sh's runs: time per op over TCP loopback
(median over runs) for meshtrain's Gloo backend on its links, OpenMPI's TCP
transport and PyTorch's Gloo, with issue 32's floors
(links at least 1.0x OpenMPI TCP from 64 KiB, at least 1.0x PyTorch's Gloo at
every size; ratios are the other's time over the links' time: >1 means the
links are faster). With --doc, replaces the tcp-collectives section of that
markdown file. Standard library only."""
import argparse, collections, json, os, statistics, sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "ddp"))
from report import replace_section  # noqa: E402  (the section writer every bench report shares)

IMPLS = [("mt_gloo_links", "meshtrain gloo (links)"), ("ompi_tcp", "OpenMPI (TCP)"), ("torch", "torch Gloo")]
OPS = ["all_reduce", "all_gather", "reduce_scatter", "broadcast"]


def human(b):
    return f"{b // 2**20} MiB" if b >= 2**20 else f"{b // 1024} KiB"


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("files", nargs="+")
    p.add_argument("--doc")
    p.add_argument("--header", default="")
    a = p.parse_args()
    times = collections.defaultdict(list)
    for path in a.files:
        name = os.path.basename(path)
        impl = next((label for prefix, label in IMPLS if name.startswith(prefix + "_")), None)
        if impl is None:
            continue
        d = json.load(open(path))
        for r in d["rows"]:
            op = "reduce_scatter" if r["op"] == "reduce_scatter (all_reduce+slice)" else r["op"]
            times[(d["world_size"], impl, op, r["bytes"])].append(r["sec_per_op"])
    med = {k: statistics.median(v) for k, v in times.items()}
    runs = max(len(v) for v in times.values())
    labels = [label for _, label in IMPLS]
    lines = [a.header, "", f"Time per op in microseconds, median of {runs} runs, 2 ranks or 4 on this machine over "
             "127.0.0.1. torch's reduce_scatter is all_reduce then slice (its Gloo group has none). Ratios: the "
             "other's time over the links' (>1: the links are faster).", ""]
    floors = []
    for w in sorted({k[0] for k in med}):
        lines += [f"### {w} ranks", "", "| op | size | " + " | ".join(labels) + " | OpenMPI TCP / links | torch / links |",
                  "|---|---|" + "---:|" * (len(labels) + 2)]
        for op in OPS:
            for b in sorted({k[3] for k in med}):
                t = {label: med.get((w, label, op, b)) for label in labels}
                links = t["meshtrain gloo (links)"]
                cells = ["n/a" if x is None else f"{x * 1e6:,.1f}" for x in t.values()]
                ratio = lambda other: None if other is None or links is None else other / links
                r_mpi, r_torch = ratio(t["OpenMPI (TCP)"]), ratio(t["torch Gloo"])
                cells += ["n/a" if r is None else f"{r:.2f}" for r in (r_mpi, r_torch)]
                lines.append(f"| {op} | {human(b)} | " + " | ".join(cells) + " |")
                if r_mpi is not None and b >= 65536:
                    floors.append((f"{w} ranks, {op} {human(b)}: links at least 1.0x OpenMPI TCP", r_mpi))
                if r_torch is not None:
                    floors.append((f"{w} ranks, {op} {human(b)}: links at least 1.0x PyTorch's Gloo", r_torch))
        lines.append("")
    met = [f for f in floors if f[1] >= 1.0]
    lines.append(f"Floors of issue 32 (TCP) met: {len(met)} of {len(floors)}.")
    lines += [f"- missed: {name}: {value:.2f}" for name, value in floors if value < 1.0]
    text = "\n".join(lines) + "\n"
    print(text)
    if a.doc:
        replace_section(a.doc, "tcp-collectives", "Collectives over TCP", text)


if __name__ == "__main__":
    sys.exit(main())
