#!/usr/bin/python3
"""Renders bench/deterministic/run.sh's results into markdown and replaces the
deterministic-mode section of docs/dp.md. Standard library only."""
import glob, json, os, statistics, sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "ddp"))
from report import publish, report_args  # noqa: E402


def load(d, name):
    path = os.path.join(d, name + ".json")
    return json.load(open(path)) if os.path.exists(path) else None


def equality_rows(d):
    rows = ["| precision | strategy | pipeline | dp 1 weights_sha256 | dp 2 | dp 4 | dp 8 | steps with loss == dp 1's "
            "(dp 2 / 4 / 8) | normal mode: steps with loss == dp 1's (dp 2 / 4 / 8) | normal mode: max relative loss "
            "difference | normal mode: weights equal (dp 2 / 4 / 8) |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for prec in ("fp32", "bf16-mixed"):
        for strat, label in (("ddp", "DDP"), ("zero1", "ZeRO-1"), ("zero3", "ZeRO-3")):
            for pipe, plabel in (("none", "none"), ("pp2", "pp 2, 1F1B")):
                runs = [load(d, f"eq_{prec}_{strat}_{pipe}_dp{dp}") for dp in (1, 2, 4, 8)]
                if any(r is None for r in runs):
                    continue
                ref = runs[0]
                shas = [r["weights_sha256"][:12] + ("" if r["weights_sha256"] == ref["weights_sha256"] else " (differs)")
                        for r in runs]
                equal = [sum(a == b for a, b in zip(r["losses"], ref["losses"])) for r in runs[1:]]
                normal = "— | — | —"
                plain = [load(d, f"normal_{strat}_{pipe}_dp{dp}") for dp in (1, 2, 4, 8)]
                if prec == "fp32" and all(plain):
                    same = " / ".join(str(sum(a == b for a, b in zip(p["losses"], plain[0]["losses"]))) for p in plain[1:])
                    diff = max(abs(a - b) / abs(b) for p in plain[1:] for a, b in zip(p["losses"], plain[0]["losses"]))
                    equal_weights = " / ".join("yes" if p["weights_sha256"] == plain[0]["weights_sha256"] else "no"
                                               for p in plain[1:])
                    normal = f"{same} | {diff:.1e} | {equal_weights}"
                steps = len(ref["losses"])
                counts = " / ".join(f"{e}/{steps}" for e in equal)
                rows.append(f"| {prec} | {label} | {plabel} | `{shas[0]}` | `{shas[1]}` | `{shas[2]}` | `{shas[3]}` | "
                            f"{counts} | {normal} |")
    return rows


def cost_rows(d):
    rows = ["| bench | dp | mode | step time (ms) | vs normal | peak RSS per rank (MiB) | gradients + buffers per "
            "rank (MiB) | dp bytes sent per step per rank (MiB) |", "|---|---|---|---:|---:|---:|---:|---:|"]
    for model, label in (("mlp", "MLP 4 x 1024, 128 samples"), ("gpt", "GPT 4 x 512, T 128, 16 samples")):
        for dp in (1, 2):
            base = None
            for mode, mlabel in (("normal", "normal"), ("grains", "normal, grain-sized micro-batches"),
                                 ("deterministic", "--deterministic (8 grains)")):
                runs = [json.load(open(p)) for p in sorted(glob.glob(os.path.join(d, f"cost_{model}_dp{dp}_{mode}_*.json")))]
                if not runs:
                    continue
                t = statistics.median(r["step_time_s"] for r in runs) * 1e3
                base = base or t
                r0 = runs[0]
                rss = max(k["peak_rss_bytes"] for k in r0["ranks"]) / 2**20
                held = max(k["state_bytes"]["gradients"] + k["state_bytes"]["buffers"] for k in r0["ranks"]) / 2**20
                sent = max(k["traffic_by_axis"]["dp"]["total"]["bytes_sent"] for k in r0["ranks"]) / 2**20
                rows.append(f"| {label} | {dp} | {mlabel} | {t:.1f} | {t / base:.2f}x | {rss:.0f} | {held:.1f} | "
                            f"{sent:.2f} |")
    return rows


def main():
    a = report_args(__doc__)
    lines = [a.header, "",
             "Equality: a GPT (2 blocks x 64, tied embedding, --clip-grad-norm 1), global batch 32 in 8 grains, 100 "
             "steps; dp x pp ranks on this 2-core machine. The SHA-256 of every parameter's float32 bytes "
             "(`weights_sha256`) after the last step, its first 12 hex digits; a layout that differs from dp 1 "
             "says so. The normal mode runs the same 8 micro-batches of 4 samples on each layout (accumulated in "
             "order on each rank, then all-reduced by the backend's algorithm): the same values, summed in "
             "layout-dependent orders. (Its dp 8 without a pipeline matches dp 1 by coincidence: one micro-batch per "
             "rank, and the shared-memory backend's small all-reduce adds the ranks in rank order, the order dp 1 "
             "accumulates them in; nothing guarantees it, as dp 2 and 4 show.)", ""]
    lines += equality_rows(a.dir)
    lines += ["", "Cost: the same global batch and model in three modes, one thread per rank, median step time of "
              "the runs (each the mean of its timed steps); memory and bytes from rank metrics (the last run's "
              "first). The normal mode reduces once per step, overlapped with backward; --deterministic reduces "
              "every grain's micro-batch, in tree order, after its backward.", ""]
    lines += cost_rows(a.dir)
    publish(lines, a.doc, "deterministic", "Deterministic mode, measured")


if __name__ == "__main__":
    main()
