#!/usr/bin/python3
"""Renders bench/faults/campaign.py's summary (the fault-campaign section of docs/BENCHMARKS.md)."""
import json, os, sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "ddp"))
from report import publish, report_args  # noqa: E402
sys.path.insert(0, os.path.dirname(__file__))
from campaign import summary  # noqa: E402

ORDER = ["kill-rank", "kill-in-save", "stop-rank", "kill-meshrun", "kill-store", "restart", "disk-full", "elastic"]


def main():
    a = report_args(__doc__)
    rows = [summary(f, json.load(open(os.path.join(a.dir, f + ".json"))))
            for f in ORDER if os.path.exists(os.path.join(a.dir, f + ".json"))]
    L = [a.header, "",
         "4 ranks (dp 2 x pp 2 and dp 2 x tp 2, alternating), a tiny GPT, one fault per trial at a random moment "
         "1-3 s into training. Detection = seconds from the fault to meshrun's first line naming a failure "
         "(kill-meshrun: until no process of the job is left). Named = meshrun's summary and every survivor's "
         "error name the faulty rank (kill-store: the lost store). Orphans = processes of the job alive after "
         "meshrun exited. Leftovers = /dev/shm segments and checkpoint .tmp files left. Restart: --max-restarts 1 "
         "--resume, the losses after the restart equal the uninterrupted run's. Disk full: checkpoints every step into a "
         "2-6 MB tmpfs; named = every rank's error says the save failed (No space left) and `latest` names a "
         "checkpoint that loads whole (checked with tools/checkpoint_to_torch.py). Elastic: two meshrun nodes of 2 ranks "
         "under --nnodes 1:2, node 1 killed at a random moment; detection = until node 0 trains on alone (its next "
         "round closed without node 1; named = that line says so); node 1 is then started again and the job grows "
         "back at the next checkpoint; resumed equal = every step's loss equals the uninterrupted one-process run's "
         "(the last round within 1e-4 relative, earlier rounds' progress lines, 4 decimals, within 2e-4; the layouts differ, and at --lr 2e-3 uninterrupted layouts differ by under 2e-5 over these 120 steps) and the job ended on both nodes.", "",
         "| fault | trials | hangs | detection min / median / max (s) | named | orphans | leftovers | resumed equal |",
         "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        det = f"{r['min']:.2f} / {r['median']:.2f} / {r['max']:.2f}" if "median" in r else "-"
        resumed = f"{r['resumed_equal']} / {r['trials']}" if "resumed_equal" in r else "-"
        L.append(f"| {r['fault']} | {r['trials']} | {r['hangs']} | {det} | {r['named']} / {r['trials']} | "
                 f"{r['orphans']} | {r['leftovers']} | {resumed} |")
    publish(L, a.doc, "faults", "Fault campaign")


if __name__ == "__main__":
    main()
