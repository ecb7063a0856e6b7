#!/usr/bin/python3
"""Renders bench/collectives/hosts.sh's results (2 hosts x 2 ranks): time per op
of each implementation per link rate, with ratios to meshtrain's hierarchical
backend, and the bytes one op put on the link between the hosts. Replaces the
"Collectives across hosts" section of docs/BENCHMARKS.md. Standard library only."""
import argparse, json, os, sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "ddp"))
from report import publish  # noqa: E402

IMPLS = [("hier", "meshtrain hierarchical (meshrun)"), ("gloo", "meshtrain gloo (meshrun)"),
         ("mpi", "meshtrain mpi (mpirun)"), ("ompi", "OpenMPI's own (mpirun)")]
CALLS = 14  # --target-s 0: 1 + 5 warm-up + 3 estimate + 5 timed


def human(b):
    return f"{b // 2**20} MiB" if b >= 2**20 else f"{b // 1024} KiB"


def ms(x):
    return "n/a" if x is None else f"{x * 1e3:,.2f}"


def training_steps(out_dir, rates):
    """The training-step table: mean step per backend and rate, bytes per step on the link."""
    path = os.path.join(out_dir, "train.bytes")
    if not os.path.exists(path):
        return []
    link = {}
    for line in open(path):
        key, rate, steps, n = line.split()
        link[(key, rate, int(steps))] = int(n)

    def step_s(key, rate):
        f = os.path.join(out_dir, f"train_{key}_{rate}_8.json")
        return json.load(open(f))["step_time_s"] if os.path.exists(f) else None

    names = [("hier", "hierarchical (meshrun)"), ("gloo", "flat gloo (meshrun)"), ("mpi", "MPI backend: OpenMPI's collectives (mpirun)")]
    lines = ["### A training step across the hosts", "",
             "DDP (`--dp 4`, 2 hosts x 2 ranks) of a GPT of 6.6M parameters (8 layers x 256, vocabulary 1024, "
             "128 tokens; S = 26.5 MB of fp32 gradients, buckets of 25 MiB), global batch 16 in micro-batches of 4: "
             "the mean step after the first of 8 (s), and the bytes one step puts on the link between the hosts "
             "(host 0's veth, both directions, a job of 8 steps less one of 3, on the first rate) in multiples of S.",
             "", "| link | " + " | ".join(n for _, n in names) + " | gloo / hier | mpi / hier |",
             "|---|" + "---:|" * (len(names) + 2)]
    for rate in rates:
        t = {k: step_s(k, rate) for k, _ in names}
        cells = [f"{t[k]:.3f}" if t[k] else "n/a" for k, _ in names]
        ratios = [f"{t[k] / t['hier']:.2f}" if t[k] and t["hier"] else "n/a" for k in ("gloo", "mpi")]
        lines.append(f"| {rate} | " + " | ".join(cells + ratios) + " |")
    first = os.path.join(out_dir, f"train_hier_{rates[0]}_8.json")
    s_bytes = 4 * json.load(open(first))["config"]["model"]["parameters"] if os.path.exists(first) else None
    cells = []
    for k, _ in names:
        a, b = link.get((k, rates[0], 3)), link.get((k, rates[0], 8))
        cells.append(f"{(b - a) / 5 / s_bytes:.2f} S" if None not in (a, b, s_bytes) else "n/a")
    lines += [f"| bytes per step ({rates[0]}) | " + " | ".join(cells) + " | | |", ""]
    return lines


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("dir")
    p.add_argument("--rates", required=True)
    p.add_argument("--doc", default=None)
    p.add_argument("--header", default="")
    a = p.parse_args()
    lines = [a.header, "",
             "2 test hosts (network namespaces, `tests/cluster/hosts.sh`) of 2 ranks each, on this 2-core machine: "
             "4 ranks share 2 cores, so the fast links measure CPU as much as the link. Each cell: time per op in "
             "ms (max over ranks); the ratios are times over meshtrain hierarchical's (>1: slower than it). "
             "mpirun ran with `--mca btl tcp,vader,self` (TCP between the hosts, shared memory inside) and "
             "`--mca mpi_yield_when_idle 1`: OpenMPI's ranks otherwise busy-poll, and 4 of them on 2 cores took "
             "94 ms for a 64 KiB all_reduce on unshaped links (20 ms yielding).", ""]
    for rate in a.rates.split():
        t = {}
        for key, _ in IMPLS:
            path = os.path.join(a.dir, f"{key}_{rate}.json")
            if os.path.exists(path):
                for r in json.load(open(path))["rows"]:
                    t[(key, r["op"], r["bytes"])] = r["sec_per_op"]
        ops = list(dict.fromkeys(k[1] for k in t))
        sizes = sorted({k[2] for k in t})
        lines += [f"### Links shaped to {rate}", "",
                  "| op | size | " + " | ".join(n for _, n in IMPLS) + " | gloo / hier | mpi / hier | OpenMPI / hier |",
                  "|---|---|" + "---:|" * (len(IMPLS) + 3)]
        for op in ops:
            for b in sizes:
                cells = [ms(t.get((k, op, b))) for k, _ in IMPLS]
                h = t.get(("hier", op, b))
                ratios = [f"{t[(k, op, b)] / h:.2f}" if h and (k, op, b) in t else "n/a" for k in ("gloo", "mpi", "ompi")]
                lines.append(f"| {op} | {human(b)} | " + " | ".join(cells + ratios) + " |")
        lines.append("")
    path = os.path.join(a.dir, "link.bytes")
    if os.path.exists(path):
        raw = {}
        for line in open(path):
            key, op, size, n = line.split()
            raw[(key, op, size)] = int(n)
        start = {k: raw.get((k, "start", s)) for k, _ in IMPLS for (kk, o, s) in raw if kk == k and o == "start"}
        lines += ["### Bytes on the link between the hosts per op", "",
                  f"Both directions, TCP/IP headers included, links unshaped: each op and size run alone for "
                  f"{CALLS} calls, less a job of a 16-byte all_reduce (starting the job), divided by {CALLS}; "
                  "in multiples of the buffer size S (all_gather: S is the gathered buffer).", "",
                  "| op | size | " + " | ".join(n for _, n in IMPLS) + " |", "|---|---|" + "---:|" * len(IMPLS)]
        for (key, op, size) in raw:
            if key != "hier" or op == "start":
                continue
            b = int(size[:-1]) * (1024 if size.endswith("K") else 2**20)
            cells = []
            for k, _ in IMPLS:
                if (k, op, size) in raw and start.get(k) is not None:
                    per_op = (raw[(k, op, size)] - start[k]) / CALLS
                    cells.append(f"{per_op / b:.2f} S")
                else:
                    cells.append("n/a")
            lines.append(f"| {op} | {human(b)} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += training_steps(a.dir, a.rates.split())
    publish(lines, a.doc, "collectives-hosts", "Collectives across hosts")


if __name__ == "__main__":
    sys.exit(main())
