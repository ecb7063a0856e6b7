#!/usr/bin/python3
"""Renders bench/ddp/run.sh's results into markdown and replaces the
data-parallel section of docs/BENCHMARKS.md. Standard library only."""
import argparse, glob, json, os, statistics


def med(paths, key):
    vals = [json.load(open(p))[key] for p in paths]
    return statistics.median(vals) if vals else float("nan")


def report_args(description):
    """The arguments of every bench/*/report.py: the results folder, --doc, --header."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("dir")
    p.add_argument("--doc")
    p.add_argument("--header", default="")
    return p.parse_args()


def publish(lines, doc_path, name, title):
    """Prints the section and, with --doc, puts it into that file."""
    text = "\n".join(lines) + "\n"
    print(text)
    if doc_path:
        replace_section(doc_path, name, title, text)


def replace_section(doc_path, name, title, text):
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    doc = open(doc_path).read() if os.path.exists(doc_path) else "# Benchmarks\n"
    block = f"{begin}\n{text}{end}"
    if begin in doc:
        doc = doc[:doc.index(begin)] + block + doc[doc.index(end) + len(end):]
    else:
        doc = doc.rstrip("\n") + f"\n\n## {title}\n\n" + block + "\n"
    open(doc_path, "w").write(doc)


def all_reduce_16m_sentence(ddp_dir):
    """The 2-rank 16 MiB all-reduce over shared memory and PyTorch's Gloo, from
    bench/collectives/run.sh's results beside ours when there are any."""
    folder = os.path.join(os.path.dirname(os.path.abspath(ddp_dir)), "collectives")

    def time_ms(pattern):
        vals = [r["sec_per_op"] for p in glob.glob(os.path.join(folder, pattern))
                for r in json.load(open(p))["rows"] if r["op"] == "all_reduce" and r["bytes"] == 1 << 24]
        return statistics.median(vals) * 1e3 if vals else None

    shm, torch = time_ms("mt_shm_w2_*.json"), time_ms("torch_w2_*.json")
    if shm is None or torch is None:
        return ""
    return (f"On this machine a 16 MiB all-reduce on 2 ranks took {shm:.1f} ms over meshtrain's shared memory against "
            f"{torch:.1f} ms through PyTorch's ProcessGroupGloo over loopback (bench/collectives/run.sh's last results). ")


def main():
    a = report_args(__doc__)
    g = lambda pat: sorted(glob.glob(os.path.join(a.dir, pat)))
    runs = len(g("mt_w2_[0-9]*.json"))
    t1, t2 = med(g("torch_w1_*.json"), "samples_per_s"), med(g("torch_w2_*.json"), "samples_per_s")
    m1, m2 = med(g("mt_w1_*.json"), "samples_per_s"), med(g("mt_w2_[0-9]*.json"), "samples_per_s")
    m2n = med(g("mt_w2_nooverlap_*.json"), "samples_per_s")
    L = [a.header, "",
         "### DDP vs PyTorch DDP", "",
         f"4 x Linear(1024, 1024) MLP, MSE, SGD, 64 samples per rank, 1 thread per rank; "
         f"samples/s, median of {runs} runs, each the mean of the timed steps (max over ranks).", "",
         "| | 1 process | 2 ranks (DDP) | scaling 2 ranks / 1 |", "|---|---|---|---|",
         f"| PyTorch (Python, Gloo) | {t1:.0f} | {t2:.0f} | {t2 / t1:.2f}x |",
         f"| meshtrain | {m1:.0f} | {m2:.0f} | {m2 / m1:.2f}x |",
         f"| **ratio meshtrain / PyTorch** | {m1 / t1:.2f} | **{m2 / t2:.2f}** | |", "",
         f"Both run the same libtorch kernels: one process computes a step in {64e3 / m1:.0f} ms (meshtrain) and "
         f"{64e3 / t1:.0f} ms (PyTorch). What DDP adds is the exchange of 16.8 MB of gradients per step. "
         f"{all_reduce_16m_sentence(a.dir)}That exchange is CPU work itself (copies "
         "and sums) on cores that backward also needs: PyTorch's DDP gives back most of what the second rank "
         "computes, meshtrain's keeps it. Both bucket gradients by the same rule (a bucket closes once it "
         "reaches its cap, the first at 1 MiB, so the last layer's 4 MB weight is all-reduced while the rest of "
         "backward runs).", "",
         "### All-reduce overlapped with backward, or after it", "",
         "| model (2 ranks) | overlapped: step s | after backward: step s | gain |", "|---|---|---|---|"]
    for model, pat in (("MLP 4x1024, 64/rank", "mt_w2"), ("GPT 4x256, seq 128, 4/rank", "mtgpt_w2")):
        on, off = med(g(pat + "_[0-9]*.json"), "step_time_s"), med(g(pat + "_nooverlap_*.json"), "step_time_s")
        L.append(f"| {model} | {on:.4f} | {off:.4f} | {off / on:.2f}x |")
    L += ["", "The overlap can only use idle CPU: on two cores shared by two ranks the all-reduce's copies and sums "
          "compete with backward for the same cores, so what it gains here is small; with a network doing the "
          "transfer and spare cores it hides the exchange behind backward.", ""]
    L += ["", "### Bytes and calls per step: the article's master DP vs DDP", "",
          "From the trainer's `--metrics-out` (traffic of the training communicator per step, payload only; "
          "global batch 24, 10 steps; the trainer keeps DDP's buckets in registration order, so no step re-buckets). "
          "Rank 0 is the master; 'other' is rank 1. Calls are the article's exchanges: the master DP broadcasts the "
          "batch's shape, scatters the batch, broadcasts the parameters, gathers the outputs, scatters the output "
          "gradients and reduces the parameter gradients onto rank 0, six per step, where DDP's gradients here fit one bucket, one "
          "all-reduce: the article's 'about 5x fewer exchanges' (6x here). In bytes the master's rank 0 carries "
          "every other rank's share, so its load grows with the ranks (1.45x DDP's at 2 ranks, 2.45x at 4 on the "
          "GPT), while DDP's per-rank bytes grow only as (n-1)/n (the ring).", "",
          "| model | ranks | DP calls | DDP calls | DP bytes rank 0 | DP bytes other | DDP bytes per rank | "
          "DP/DDP bytes, rank 0 | DP/DDP calls |", "|---|---|---|---|---|---|---|---|---|"]
    for model in ("mlp", "gpt"):
        for w in (2, 3, 4):
            try:
                dp = json.load(open(os.path.join(a.dir, f"traffic_{model}_dp_w{w}.json")))["ranks"]
                ddp = json.load(open(os.path.join(a.dir, f"traffic_{model}_ddp_w{w}.json")))["ranks"]
            except FileNotFoundError:
                continue
            tot = lambda r: r["traffic"]["total"]
            b = lambda r: tot(r)["bytes_sent"] + tot(r)["bytes_received"]
            L.append(f"| {model} | {w} | {tot(dp[0])['calls']:.0f} | {tot(ddp[0])['calls']:.1f} | {b(dp[0]):,.0f} | "
                     f"{b(dp[1]):,.0f} | {b(ddp[0]):,.0f} | {b(dp[0]) / b(ddp[0]):.2f} | "
                     f"{tot(dp[0])['calls'] / tot(ddp[0])['calls']:.1f}x |")
    publish(L, a.doc, "ddp", "Data parallelism")


if __name__ == "__main__":
    main()
