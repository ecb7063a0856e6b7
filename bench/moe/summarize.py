"""The tables of bench/moe/run.sh from the runs' --metrics-out files."""
import datetime
import json
import os
import statistics
import sys

out, steps, data = sys.argv[1], int(sys.argv[2]), sys.argv[3]


def load(name):
    with open(os.path.join(out, name + ".json")) as f:
        return json.load(f)


def mean_imbalance(step):  # the busiest expert over the mean, averaged over the layers
    return statistics.mean(max(layer) / (sum(layer) / len(layer)) for layer in step)


runs = [("dense, MLP 512", "dense-1", 1), ("MoE 8 x 256, top-2", "moe-1", 1),
        ("dense, MLP 512, DDP", "dense-2", 2), ("MoE 8 x 256, top-2, --ep 2", "moe-ep2", 2)]
print(f"Measured {datetime.date.today()} with bench/moe/run.sh on {os.cpu_count()} cores: Llama 4 layers, hidden 128,")
print(f"4 heads (2 key/value), T 64, global batch 32, byte tokens of {os.path.basename(data)}, AdamW lr 2e-3,")
print(f"{steps} steps, fp32, one thread per rank. Tokens/s: the mean step after the first; loss: the mean of the last")
print("20 steps; the MoE runs with the default balance loss (--aux-loss-coef 0.01).")
print()
print("| model | ranks | parameters | active per token | tokens/s | loss (last 20 steps) | tokens/s vs dense |")
print("|---|---:|---:|---:|---:|---:|---:|")
dense_speed = {}
for label, name, ranks in runs:
    m = load(name)
    model = m["config"]["model"]
    speed = m["tokens_per_s"]
    if name.startswith("dense"):
        dense_speed[ranks] = speed
    active = model.get("active_parameters", model["parameters"])
    print(f"| {label} | {ranks} | {model['parameters']:,} | {active:,} | {speed:,.0f} | "
          f"{statistics.mean(m['losses'][-20:]):.4f} | {speed / dense_speed[ranks]:.2f} |")
print()
print("The router's balance, one process: the busiest expert's routes over the mean (1 = perfect, 4 = every")
print("token on the same 2 of 8 experts), averaged over the 4 layers, at steps through the run; and layer 0's")
print("routes per expert at the last step.")
print()
marks = sorted({1, steps // 4, steps // 2, 3 * steps // 4, steps})
print("| --aux-loss-coef | " + " | ".join(f"step {s}" for s in marks) + " | layer 0's routes per expert, last step | loss (last 20) |")
print("|---:|" + "---:|" * len(marks) + "---|---:|")
for coef, name in (("0", "moe-noaux-1"), ("0.01", "moe-1"), ("0.1", "moe-aux0.1-1")):
    m = load(name)
    loads = m["experts"]["router_load"]
    cells = " | ".join(f"{mean_imbalance(loads[s - 1]):.2f}" for s in marks)
    print(f"| {coef} | {cells} | {loads[-1][0]} | {statistics.mean(m['losses'][-20:]):.4f} |")
