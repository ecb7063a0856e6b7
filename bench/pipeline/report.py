#!/usr/bin/python3
"""Renders bench/pipeline/run.sh's results (the pipeline section of docs/BENCHMARKS.md)."""
import glob, json, os, sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "ddp"))
from report import publish, report_args  # noqa: E402


def main():
    a = report_args(__doc__)
    L = [a.header, "", "### Bubble: measured vs (p-1)/(m+p-1)", "",
         "Synthetic stages (forward sleeps 20 ms, backward 40 ms; halved per chunk when interleaved, V = 2), so the "
         "measured bubble is the schedule's and the executor's, not the two shared cores'. Bubble = mean over ranks of "
         "idle / span of the last step; ideal = (p-1)/(m+p-1), divided by V when interleaved, (p-1)/p for naive. "
         "Activations in flight: the most micro-batches rank 0 held for backward.", "",
         "| schedule | p | m | bubble measured | ideal | step (ms) | activations in flight (rank 0) |",
         "|---|---|---|---|---|---|---|"]
    rows = [json.load(open(f)) for f in glob.glob(os.path.join(a.dir, "syn_*.json"))]
    order = {"naive": 0, "gpipe": 1, "1f1b": 2, "interleaved": 3}
    for r in sorted(rows, key=lambda r: (r["pp"], order[r["schedule"]], r["microbatches"])):
        L.append(f"| {r['schedule']} | {r['pp']} | {r['microbatches']} | {100 * r['bubble_measured']:.1f}% | "
                 f"{100 * r['bubble_ideal']:.1f}% | {1000 * r['step_s']:.0f} | {r['max_in_flight_rank0']} |")
    L += ["", "### The GPT on the trainer: each schedule vs naive model parallelism", "",
          "GPT 8 layers x 128 hidden, global batch 32, 8 micro-batches (naive: 1), 1 data-parallel replica; "
          "mean step time of steps 2-6. With p = 4 the four ranks share two cores, so compute stretches and "
          "the comparison between schedules, not the absolute numbers, is what carries over.", "",
          "| p | schedule | samples/s | vs naive | bubble measured | ideal | activations in flight | peak RSS (MiB, max rank) |",
          "|---|---|---|---|---|---|---|---|"]
    for pp in (2, 4):
        base = None
        for s in ("naive", "gpipe", "1f1b", "interleaved"):
            path = os.path.join(a.dir, f"gpt_{s}_p{pp}.json")
            if not os.path.exists(path):
                continue
            d = json.load(open(path))
            sps = d["samples_per_s"]
            base = base or sps
            pl = d["pipeline"]
            rss = max(r["peak_rss_bytes"] for r in d["ranks"]) / 2**20
            L.append(f"| {pp} | {s} | {sps:.0f} | {sps / base:.2f}x | {100 * pl['bubble_measured']:.0f}% | "
                     f"{100 * pl['bubble_ideal']:.0f}% | {pl['max_activations_in_flight']} | {rss:.0f} |")
    L += ["", "Timelines (synthetic workload, p = 4, m = 8): "
          "![GPipe](images/gpipe_pp4_m8.svg) ![1F1B](images/1f1b_pp4_m8.svg) "
          "![interleaved](images/interleaved_pp4_m8_v2.svg) ![naive](images/naive_pp4.svg)"]
    publish(L, a.doc, "pipeline", "Pipeline parallelism")


if __name__ == "__main__":
    main()
