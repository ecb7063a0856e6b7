#!/usr/bin/python3
"""Renders bench/zero/run.sh's metrics into markdown (the ZeRO section of
docs/BENCHMARKS.md). Standard library only."""
import glob, json, os, statistics, sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "ddp"))
from report import publish, report_args  # noqa: E402


def main():
    a = report_args(__doc__)
    L = [a.header, ""]
    runs = {}
    for path in glob.glob(os.path.join(a.dir, "zero*_n*_*.json")):
        z, n, _ = os.path.basename(path)[4:-5].split("_")
        runs.setdefault((int(z), int(n[1:])), []).append(json.load(open(path)))
    if not runs:
        print("no results")
        return
    psi = next(iter(runs.values()))[0]["config"]["model"]["parameters"]
    L += [f"GPT with {psi:,} parameters (8 layers, hidden 128), fp32, AdamW; Psi = parameter count. "
          "Model state = the bytes of parameters + gradients + optimizer state each rank holds "
          "(from the tensors), against the paper's model: DDP 16 Psi, stage 1 8 Psi + 8 Psi/N, "
          "stage 2 4 Psi + 12 Psi/N, stage 3 16 Psi/N. Stage 3's gathered units are reported apart "
          "(peak bytes of full parameters gathered at once).", "",
          "| N | stage | model state / rank (B) | paper model (B) | measured / model | gathered units (B) | "
          "bytes sent / step / rank | vs DDP | peak RSS (MiB) | step time (s) | vs DDP |",
          "|---|---|---|---|---|---|---|---|---|---|---|"]
    for n in (2, 4):
        base_sent = base_time = None
        for z in (0, 1, 2, 3):
            rs = runs.get((z, n))
            if not rs:
                continue
            r1 = rs[0]["ranks"][1]
            held = r1["state_bytes"]["model_state"]
            model = {0: 16 * psi, 1: 8 * psi + 8 * psi / n, 2: 4 * psi + 12 * psi / n, 3: 16 * psi / n}[z]
            sent = statistics.median(r["ranks"][1]["traffic"]["total"]["bytes_sent"] for r in rs)
            rss = statistics.median(max(x["peak_rss_bytes"] for x in r["ranks"]) for r in rs) / 2**20
            t = statistics.median(r["step_time_s"] for r in rs)
            if z == 0:
                base_sent, base_time = sent, t
            gathered = r1["state_bytes"]["buffers"] if z == 3 else 0
            L.append(f"| {n} | {'DDP' if z == 0 else z} | {held:,} | {model:,.0f} | {held / model:.4f} | {gathered:,} | "
                     f"{sent:,.0f} | {sent / base_sent:.2f}x | {rss:.0f} | {t:.3f} | {t / base_time:.2f}x |")
    L += ["", f"Median over {len(next(iter(runs.values())))} runs for traffic, RSS and step time. Traffic is the payload "
          "the algorithms moved (verification headers excluded). Stage 3 gathers each block twice (forward, "
          "backward) and reduce-scatters once: 1.5x DDP, less for the embedding, which the tied LM head "
          "keeps gathered for the whole step (gathered once)."]
    publish(L, a.doc, "zero", "ZeRO")


if __name__ == "__main__":
    main()
