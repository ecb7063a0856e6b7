#!/usr/bin/python3
"""Renders bench/checkpoint/run.sh's metrics (the checkpoint section of docs/BENCHMARKS.md)."""
import glob, json, os, statistics, sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "ddp"))
from report import publish, report_args  # noqa: E402


def main():
    a = report_args(__doc__)
    L = [a.header, "",
         "GPT 8 layers x 256 hidden (6.6 M parameters, AdamW), 2 ranks, saving every 2 steps (3 saves per run). "
         "Bytes = all ranks' shards of one checkpoint (parameters once per replica group, optimizer state once). "
         "Save = the time the training loop is blocked (write, fsync, rename, all-gather of checksums, manifest, "
         "latest); load = read, SHA-256 verification and assembly under the same layout. Medians over runs.", "",
         "| layout | checkpoint (MB) | save (s) | save MB/s | blocked / step time | load (s) | load MB/s | step time (s) |",
         "|---|---|---|---|---|---|---|---|"]
    for tag, name in (("dp2", "dp 2 (DDP)"), ("dp2zero3", "dp 2, ZeRO 3"), ("pp2", "pp 2")):
        saves = [json.load(open(f)) for f in glob.glob(os.path.join(a.dir, f"save_{tag}_*.json"))]
        loads = [json.load(open(f)) for f in glob.glob(os.path.join(a.dir, f"load_{tag}_*.json"))]
        if not saves:
            continue
        mb = statistics.median(s["checkpoint"]["save_bytes_all_ranks"] / s["checkpoint"]["saves"] / 1e6 for s in saves)
        per_save = statistics.median(s["checkpoint"]["save_seconds"] / s["checkpoint"]["saves"] for s in saves)
        step = statistics.median(s["step_time_s"] for s in saves)
        load = statistics.median(l["checkpoint"]["load_seconds"] for l in loads)
        L.append(f"| {name} | {mb:.1f} | {per_save:.3f} | {mb / per_save:.0f} | {per_save / step:.2f} | {load:.3f} | "
                 f"{mb / load:.0f} | {step:.3f} |")
    L += ["", "Saves are synchronous: the loop waits for the fsyncs and the commit. The shards are written in "
          "parallel by the ranks; the page cache makes these figures the machine's, not a disk's."]
    publish(L, a.doc, "checkpoint", "Checkpoints")


if __name__ == "__main__":
    main()
