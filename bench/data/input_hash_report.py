#!/usr/bin/python3
"""The input-hash table (bench/data/input_hash.sh): hashing alone, and a job's steps while it hashes vs after."""
import json, os, re, statistics, sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "ddp"))
from report import publish, report_args  # noqa: E402

a = report_args(__doc__)
h = json.loads(open(os.path.join(a.dir, "hash.json")).read().strip().splitlines()[-1])
log = open(os.path.join(a.dir, "train.log")).read()
m = re.search(r"input files the same on every rank: (\d+) file\(s\), ([\d.]+) MB, hashed in ([\d.]+) s "
              r"\(compared after step (\d+)\)", log)
steps = [json.loads(line)["seconds"] for line in open(os.path.join(a.dir, "train.json.steps.jsonl"))]
during, after = steps[1:int(m.group(4))], steps[int(m.group(4)) + 1:]  # the first step warms up
L = [a.header, "",
     f"A token shard of {h['gb']:.2f} GB. Alone: XXH3-128 (files::content_hash, what every rank computes) "
     "from the disk (its pages dropped from the cache first) and from the page cache, best of 3, beside "
     "sha256sum from the page cache. In a job: 2 ranks train a small GPT (2 layers, hidden 64, global batch 16) "
     "on the shard while each rank's background thread, at nice 10, hashes it; the ranks compare the hashes at "
     "the first step all have them. Step times are medians from the metrics' per-step lines, steps while the "
     "hash ran (after the first) against steps after the comparison, in the same run.", "",
     "| measure | value |", "|---|---|",
     f"| XXH3-128 alone, from the disk | {h['xxh3_cold_s']:.2f} s ({h['gb'] / h['xxh3_cold_s']:.2f} GB/s) |",
     f"| XXH3-128 alone, page cache | {h['xxh3_warm_s']:.2f} s ({h['gb'] / h['xxh3_warm_s']:.2f} GB/s) |",
     f"| sha256sum alone, page cache | {h['sha256sum_warm_s']:.2f} s ({h['gb'] / h['sha256sum_warm_s']:.2f} GB/s) |",
     f"| in the job: hashed in (each rank, background) | {float(m.group(3)):.2f} s; compared after step {m.group(4)} |",
     f"| in the job: median step while hashing | {1000 * statistics.median(during):.1f} ms ({len(during)} steps) |"
     if during else "| in the job: median step while hashing | (compared after the first step) |",
     f"| in the job: median step after | {1000 * statistics.median(after):.1f} ms ({len(after)} steps) |"]
publish(L, a.doc, "input-file-hashes", "Input file hashes")
