#!/usr/bin/python3
"""Renders bench/precision/run.sh's metrics (the mixed-precision section of docs/BENCHMARKS.md)."""
import glob, json, os, statistics, sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "ddp"))
from report import publish, report_args  # noqa: E402


def load(d, pat):
    return [json.load(open(f)) for f in sorted(glob.glob(os.path.join(d, pat)))]


def speed(d, pat):
    return statistics.median(r["samples_per_s"] for r in load(d, pat))


def shape(m):
    c = m["config"]["model"]
    return (f"{c['layers']} layers x {c['hidden']} hidden, {c['heads']} heads, vocabulary {c['vocab']}, "
            f"sequence {c['seq_len']}, batch {m['config']['global_batch']} ({c['parameters']:,} parameters)")


def main():
    a = report_args(__doc__)
    out = [a.header, "",
           "AdamW; one process with one thread, or 2 ranks (one thread each) under meshrun (with 2 threads in one process, OpenBLAS's and libtorch's thread pools contend on 2 cores: the fp32 GPT ran at 440 to 1,900 samples/s from run to run). samples/s: median over "
           "runs of each run's mean step time after the first. This CPU has AVX-512 BF16: a 1024^3 matrix product "
           "takes 10.9 ms in fp32 and 5.2 ms in bf16 through libtorch 1.13 (oneDNN), 2.1x.", "",
           "| model | layout | fp32: samples/s | bf16-mixed: samples/s | bf16 / fp32 |", "|---|---|---|---|---|"]
    for name in ("small", "large"):
        f, b = speed(a.dir, f"{name}_fp32_*.json"), speed(a.dir, f"{name}_bf16-mixed_*.json")
        out.append(f"| GPT {shape(load(a.dir, f'{name}_fp32_*.json')[0])} | one process | {f:.0f} | {b:.0f} | "
                   f"{b / f:.2f} |")
    f = speed(a.dir, "ddp_fp32_*.json")
    for r in ("bf16", "fp32"):
        b = speed(a.dir, f"ddp_bf16_reduce_{r}_*.json")
        out.append(f"| same, large | DDP, 2 ranks, reduce in {r} | {f:.0f} | {b:.0f} | {b / f:.2f} |")
    out += ["", "On the default GPT (64 hidden) the matrix products are too small for bf16 to pay: the casts to "
            "and from float32 (every gradient, every master each step) and bf16's slower elementwise kernels cost "
            "what the products save. On the 512-hidden GPT the products dominate and bf16 runs 2.5x faster in one "
            "process; under DDP the ratio is higher still because each rank's batch is half the size, at which "
            "libtorch's bf16 kernels measured faster per sample than at 16 (not investigated further).", "",
            "DDP's all-reduce bytes sent per step and rank (the metrics' traffic):", "",
            "| precision | reduce dtype | all-reduce bytes / step | vs fp32 |", "|---|---|---|---|"]
    base = load(a.dir, "ddp_fp32_*.json")[0]["ranks"][0]["traffic"]["all_reduce"]["bytes_sent"]
    out.append(f"| fp32 | fp32 | {base:,.0f} | 1.00 |")
    for r in ("bf16", "fp32"):
        b = load(a.dir, f"ddp_bf16_reduce_{r}_*.json")[0]["ranks"][0]["traffic"]["all_reduce"]["bytes_sent"]
        out.append(f"| bf16-mixed | {r} | {b:,.0f} | {b / base:.2f} |")
    f32, b16 = load(a.dir, "curve_fp32.json")[0]["losses"], load(a.dir, "curve_bf16-mixed.json")[0]["losses"]
    n = len(f32)
    out += ["", f"Loss of the default GPT over {n} steps (global-batch loss; mean over each window of steps):", "",
            "| steps | fp32 | bf16-mixed | difference |", "|---|---|---|---|"]
    w = max(1, n // 6)
    for s in range(0, n, w):
        x, y = statistics.mean(f32[s:s + w]), statistics.mean(b16[s:s + w])
        out.append(f"| {s + 1}-{min(n, s + w)} | {x:.4f} | {y:.4f} | {y - x:+.4f} |")
    publish(out, a.doc, "precision", "Mixed precision (bf16)")


if __name__ == "__main__":
    main()
