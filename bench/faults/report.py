#!/usr/bin/python3
"""Renders bench/faults/campaign.py's summary (the fault-campaign section of docs/BENCHMARKS.md)."""
import json, os, sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "ddp"))
from report import publish, report_args  # noqa: E402
sys.path.insert(0, os.path.dirname(__file__))
from campaign import summary  # noqa: E402

ORDER = ["kill-rank", "kill-in-save", "stop-rank", "kill-meshrun", "kill-store", "restart", "disk-full", "elastic"]
REFUSALS = ["desync-flag", "changed-data", "shared-save-dir", "rewritten-in-place"]  # refusals, not failures


def load_runs(a, faults):
    """fault -> its trials, for the faults of `faults` that the campaign ran."""
    return {f: json.load(open(os.path.join(a.dir, f + ".json")))
            for f in faults if os.path.exists(os.path.join(a.dir, f + ".json"))}


def refusal_rows(runs):
    """The summary table of refusals: a row per fault, its time to the refusal and what was lost."""
    L = ["| fault | trials | hangs | time min / median / max (s) | named | orphans | leftovers | lost |",
         "|---|---|---|---|---|---|---|---|"]
    for f, results in runs.items():
        r = summary(f, results)
        det = f"{r['min']:.2f} / {r['median']:.2f} / {r['max']:.2f}" if "median" in r else "-"
        L.append(f"| {f} | {r['trials']} | {r['hangs']} | {det} | {r['named']} / {r['trials']} | {r['orphans']} | "
                 f"{r['leftovers']} | {r['lost']} |")
    return L


def refusal_section(a):
    """The desync-flag and changed-data rows, with a line per variant."""
    runs = load_runs(a, REFUSALS)
    if not runs:
        return
    L = [a.header, "",
         "4 ranks (dp 2 x pp 2 and dp 2 x tp 2, alternating), a tiny GPT resuming a saved 10-step run "
         "(--resume --save-every 5). desync-flag: one random rank gets another setting than the others (the "
         "variants below, each on both layouts in turn). changed-data: one random rank reads other bytes under the "
         "same relative --data (it starts in another directory), or the shard every rank maps is changed 1-2 s into "
         "training. shared-save-dir: a second job started 0-1.5 s after a first with the same --save-dir (--save-every 5 "
         "--keep-last 3); one must be refused naming the other, whose checkpoints must all be there. "
         "rewritten-in-place: 4 KiB of the shard rewritten with valid ids, the size unchanged, 0-1 s after the first "
         "checkpoint of a job saving every step. Time = seconds from the start (changed while training: from the change; a second "
         "job: from the later start) to meshrun's line "
         "saying the job failed. Named = the job failed and its output names the flag or variable (a flag in the "
         "start-up check's sentence \"--save-every is 5 on rank 0 but 3 on rank 2\") or the shard. Lost = files of "
         "the saved checkpoints changed or missing afterwards, plus one when `latest` no longer names a checkpoint "
         "that loads whole (tools/checkpoint_to_torch.py); for shared-save-dir, the winner's checkpoints missing "
         "or a checkpoint of the refused job in the directory; for rewritten-in-place, a checkpoint of a step "
         "after the write.", "",
         ] + refusal_rows(runs)
    L += ["", "| fault | variant | trials | named | hangs | lost |", "|---|---|---|---|---|---|"]
    for f, results in runs.items():
        for variant in dict.fromkeys(x["variant"] for x in results):
            rows = [x for x in results if x["variant"] == variant]
            L.append(f"| {f} | {variant} | {len(rows)} | {sum(bool(x['named']) for x in rows)} | "
                     f"{sum(x['hang'] for x in rows)} | {sum(x['lost'] for x in rows)} |")
    publish(L, a.doc, "faults-refusals", "Refusal campaign: desynchronised flags and changed data")


RENDEZVOUS = ["stranger-frames", "flag-mismatch"]  # issue 54, items 5 and 6


def rendezvous_section(a):
    """The stranger-frames and flag-mismatch rows: two meshrun nodes meeting."""
    runs = load_runs(a, RENDEZVOUS)
    if not runs:
        return
    L = [a.header, "",
         "Two meshrun nodes of 2 ranks on loopback (a tiny GPT, dp 2 x pp 2 and dp 2 x tp 2, alternating) resuming a "
         "saved 10-step run (--resume --save-every 5). stranger-frames: while node 0 waits for node 1, a process "
         "without the token sends its store one of the variants below (ten declines: ten connections); node 1 starts "
         "0.3-1.5 s later. Time = from the stranger's frame to node 0's first line naming the stranger's address; "
         "named = both nodes trained to step 20 (exit 0) and node 0 said that address (the refusal line; for a huge "
         "frame the store's own line). flag-mismatch: one node started with another meshrun flag, or only node 1 with "
         "the token file, the nodes started in a random order 0-1 s apart; time = from the second node's start to "
         "the later of the two nodes' lines naming the difference; named = both nodes exit 2 and both say the node, "
         "the flag, both values and the fix. Lost = files of the saved checkpoints changed or missing, plus one when "
         "`latest` does not load (and, for stranger-frames, when step 20 was not saved).", "",
         ] + refusal_rows(runs)
    L += ["", "| fault | variant | trials | named | time median (s) | lost |", "|---|---|---|---|---|---|"]
    for f, results in runs.items():
        for variant in dict.fromkeys(x["variant"] for x in results):
            rows = [x for x in results if x["variant"] == variant]
            det = sorted(x["detection"] for x in rows if x["detection"] is not None)
            median = f"{det[len(det) // 2]:.2f}" if det else "-"
            L.append(f"| {f} | {variant} | {len(rows)} | {sum(bool(x['named']) for x in rows)} | {median} | "
                     f"{sum(x['lost'] for x in rows)} |")
    publish(L, a.doc, "faults-rendezvous", "Refusal campaign: strangers and meshrun flags while the nodes meet")


PARTITIONS = ["cut", "cut-in", "cut-out", "frozen-host", "slow-link"]


def partition_section(a):
    """The partition rows (bench/faults/partitions.py): links and hosts across two test hosts."""
    runs = load_runs(a, PARTITIONS)
    if not runs:
        return
    L = [a.header, "",
         "Two test hosts (network namespaces with their own hostname, address and /dev/shm, through a bridge), a "
         "meshrun node of 2 ranks on each (a tiny GPT, dp 2 x pp 2 and dp 2 x tp 2, alternating), "
         "MESHTRAIN_LINK_TIMEOUT_S=4, --comm-timeout 6; one fault on host 1 1-3 s into training. Detection = "
         "seconds from the fault to node 0's first line naming a failure; end = until every node that can still "
         "run has exited. Named = node 0's summary names a rank of host 1 as unreachable through the link to host "
         "1 (frozen host: as stuck) and node 1, where it can run, names its link to the store. Orphans and "
         "leftovers (files in /dev/shm) in the hosts that can still run. Slow link: host 1's link from 1 Gbit/s "
         "to 10 Mbit/s; named = the job trained on with no failure reported, detection column = step time after "
         "/ before, end = from SIGTERM to both meshruns' exit.", "",
         "| fault | trials | hangs | detection min / median / max | end median / max (s) | named | orphans | "
         "leftovers |", "|---|---|---|---|---|---|---|---|"]
    for f, results in runs.items():
        r = summary(f, results)
        det = f"{r['min']:.2f} / {r['median']:.2f} / {r['max']:.2f}" if "median" in r else "-"
        ends = sorted(x["end"] for x in results if x.get("end") is not None)
        end = f"{ends[len(ends) // 2]:.2f} / {ends[-1]:.2f}" if ends else "-"
        L.append(f"| {f} | {r['trials']} | {r['hangs']} | {det} | {end} | {r['named']} / {r['trials']} | "
                 f"{r['orphans']} | {r['leftovers']} |")
    publish(L, a.doc, "faults-partitions", "Partition campaign: links and hosts across two test hosts")


def main():
    a = report_args(__doc__)
    refusal_section(a)
    rendezvous_section(a)
    partition_section(a)
    rows = [summary(f, json.load(open(os.path.join(a.dir, f + ".json"))))
            for f in ORDER if os.path.exists(os.path.join(a.dir, f + ".json"))]
    if not rows:
        return
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
