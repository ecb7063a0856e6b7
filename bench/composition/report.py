#!/usr/bin/python3
"""Renders bench/composition/run.sh's metrics into markdown (the "ZeRO-3 under
pipelining" section of docs/BENCHMARKS.md). Standard library only."""
import glob, json, os, statistics, sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "ddp"))
from report import publish, report_args  # noqa: E402


def dp_sent(run, rank=0):
    return run["ranks"][rank]["traffic_by_axis"]["dp"]["total"]["bytes_sent"]


def main():
    a = report_args(__doc__)
    runs = {}
    for path in glob.glob(os.path.join(a.dir, "zero*_m*_*.json")):
        z, m, _ = os.path.basename(path)[4:-5].split("_")
        runs.setdefault((int(z), int(m[1:])), []).append(json.load(open(path)))
    if not runs:
        print("no results")
        return
    ms = sorted({m for _, m in runs})
    psi = next(iter(runs.values()))[0]["config"]["model"]["parameters"]
    L = [a.header, "",
         f"GPT with {psi:,} parameters (6 layers, hidden 128), dp 2 x pp 2, 1F1B, global batch 32, fp32 AdamW. "
         "Bytes the data axis sends per step from rank 0 (stage 0 of the first replica), from the "
         "Communicator's accounting; ratio to DDP at the same number of micro-batches; step time in parentheses "
         "(median of the runs).", "",
         "| data axis | " + " | ".join(f"m = {m}" for m in ms) + " |",
         "|---|" + "---|" * len(ms)]
    for z in (0, 1, 2, 3):
        cells = []
        for m in ms:
            rs, base = runs.get((z, m)), runs.get((0, m))
            if not rs or not base:
                cells.append("-")
                continue
            sent = statistics.median(dp_sent(r) for r in rs)
            ratio = sent / statistics.median(dp_sent(r) for r in base)
            t = statistics.median(r["step_time_s"] for r in rs)
            cells.append(f"{sent:,.0f} B, {ratio:.2f}x ({t:.3f} s)")
        L.append(f"| {'DDP' if z == 0 else 'ZeRO-' + str(z)} | " + " | ".join(cells) + " |")
    L += ["", "On dp = 2 a ring all-reduce sends about 4 B per parameter of the stage (DDP), a reduce-scatter or an "
          "all-gather half of that. DDP and ZeRO-1 reduce the gradients once per step, whatever the number of "
          "micro-batches m. ZeRO-2 keeps only its gradient shard, so it reduce-scatters after every "
          "micro-batch's backward, then all-gathers the updated parameters once: (m + 1) / 2 x DDP. ZeRO-3 "
          "gathers each unit's parameters for every micro-batch's forward and again for its backward and "
          "reduce-scatters every micro-batch: about 1.5 m x DDP, less: the tied embedding stays gathered for "
          "the step, and a unit still gathered when its backward starts is not gathered again (the trainer's "
          "ZeRO-3 is zero::fully_shard since 2026-12-04; the explicit wrapper before it sent 2.97x, 5.93x "
          "and 11.87x at m = 2, 4, 8). That is the price of holding 1/dp of the parameters under a pipeline, and "
          "why DeepSpeed refuses the combination; meshtrain runs it, trains like one process, and reports the "
          "cost. With few micro-batches, or where parameters would not fit otherwise, it is the right trade."]
    publish(L, a.doc, "zero-pp", "ZeRO-3 under pipelining")


if __name__ == "__main__":
    main()
