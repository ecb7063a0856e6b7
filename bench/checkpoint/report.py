#!/usr/bin/python3
"""Renders bench/checkpoint/run.sh's metrics (the checkpoint section of docs/BENCHMARKS.md)."""
import glob, json, os, statistics, sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "ddp"))
from report import publish, report_args  # noqa: E402


def main():
    a = report_args(__doc__)
    L = [a.header, "",
         "GPT 8 layers x 256 hidden (6.6 M parameters, AdamW), 2 ranks, saving every 2 steps (3 saves per run). "
         "Bytes = all ranks' shards of one checkpoint (torch.save archives; each replicated tensor written once, split over the data-parallel ranks). "
         "Blocked = the time the training loop waits per save: synchronous, the whole save (write, fsync, rename, "
         "all-gather of checksums, manifest, latest); with --async-save, the snapshot (the state copied into staging buffers kept from the previous save; encoding, checksum and writing happen in the background) and "
         "any wait for the previous save. Written = the whole save, in the background with --async-save. "
         "Load = read, SHA-256 verification and assembly under the same layout. Medians over runs.", "",
         "| layout | checkpoint (MB) | blocked (s) | blocked / step time | written (s) | save MB/s | load (s) | load MB/s | step time (s) |",
         "|---|---|---|---|---|---|---|---|---|"]
    for tag, name in (("dp2", "dp 2 (DDP)"), ("dp2asyncsave", "dp 2 (DDP), --async-save"), ("dp2zero3", "dp 2, ZeRO 3"),
                      ("dp2zero3asyncsave", "dp 2, ZeRO 3, --async-save"), ("pp2", "pp 2"), ("pp2asyncsave", "pp 2, --async-save")):
        saves = [json.load(open(f)) for f in glob.glob(os.path.join(a.dir, f"save_{tag}_*.json"))]
        loads = [json.load(open(f)) for f in glob.glob(os.path.join(a.dir, f"load_{tag}_*.json"))]
        if not saves:
            continue
        mb = statistics.median(s["checkpoint"]["save_bytes_all_ranks"] / s["checkpoint"]["saves"] / 1e6 for s in saves)
        per_save = statistics.median(s["checkpoint"]["save_seconds"] / s["checkpoint"]["saves"] for s in saves)
        written = statistics.median((s["checkpoint"].get("background_seconds") or s["checkpoint"]["save_seconds"])
                                    / s["checkpoint"]["saves"] for s in saves)
        step = statistics.median(s["step_time_s"] for s in saves)
        load = statistics.median(l["checkpoint"]["load_seconds"] for l in loads)
        L.append(f"| {name} | {mb:.1f} | {per_save:.3f} | {per_save / step:.2f} | {written:.3f} | {mb / written:.0f} | "
                 f"{load:.3f} | {mb / load:.0f} | {step:.3f} |")
    hash_file = os.path.join(a.dir, "hash.txt")
    if os.path.exists(hash_file):
        L += ["", "Checksum: " + open(hash_file).read().strip() + " (OpenSSL's SHA-256 with the CPU's SHA "
              "extensions; the portable implementation it replaced ran at 0.28 GB/s)."]
    L += ["", "The shards are written in parallel by the ranks; the page cache makes these figures the machine's, "
          "not a disk's. With --async-save the step after a save shares the cores with the writer thread."]
    publish(L, a.doc, "checkpoint", "Checkpoints")


if __name__ == "__main__":
    main()
