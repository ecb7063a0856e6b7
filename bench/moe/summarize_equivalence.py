"""The tables of bench/moe/equivalence.sh from the runs' --metrics-out files."""
import datetime
import json
import os
import statistics
import sys

out, steps, timed_steps, repeats = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
layouts = [layout.split("|") for layout in sys.argv[5:]]


def load(name):
    with open(os.path.join(out, name + ".json")) as f:
        return json.load(f)


def max_loss_difference(name, reference):
    return max(abs(a - b) for a, b in zip(load(name)["losses"], reference))


one = load("one")["losses"]
config = load("one")["config"]
print(f"Measured {datetime.date.today()} with bench/moe/equivalence.sh on {os.cpu_count()} cores: "
      f"{config['model']['kind']} of {config['model']['layers']} layers,")
print(f"hidden {config['model']['hidden']}, 4 experts top-2, --aux-loss-coef "
      f"{config['model']['aux_loss_coef']} (the default), global batch {config['global_batch']} of "
      f"{config['model']['seq_len']} tokens of the built-in task,")
print(f"{steps} steps, fp32. Each cell: the largest |loss - one process's| over the steps, one process running the")
print("global batch at once (where the two scopes are the same loss). The pipeline rows run GPipe under the")
print("global scope (its default there) and 1F1B under the micro one.")
print()
print("| layout | ranks | flags | global (default) | micro |")
print("|---|---:|---|---:|---:|")
for name, ranks, flags in layouts:
    print(f"| {name} | {ranks} | `{flags}` | {max_loss_difference(name + '-global', one):.1e} | "
          f"{max_loss_difference(name + '-micro', one):.1e} |")
print()


def timed(scope, field):
    values = []
    for i in range(1, repeats + 1):
        m = load(f"timed-{scope}-{i}")
        values.append(field(m))
    return values


def dp_bytes(m):
    return m["ranks"][0]["traffic_by_axis"]["dp"]["total"]["bytes_sent"]


def step_time(m):  # the median step after the first
    return statistics.median(m["step_times_s"][1:])


print(f"The cost, dp 2 with 4 micro-batches of 3 samples per rank, {timed_steps} steps, {repeats} runs of each "
      "alternating (median step after the first; medians over the runs):")
print()
print("| scope | s/step | peak RSS, rank 0 | dp bytes sent per step, rank 0 |")
print("|---|---:|---:|---:|")
rows = {}
for scope in ("global", "micro"):
    rows[scope] = (statistics.median(timed(scope, step_time)),
                   statistics.median(timed(scope, lambda m: m["ranks"][0]["peak_rss_bytes"])),
                   statistics.median(timed(scope, dp_bytes)))
    t, rss, sent = rows[scope]
    print(f"| {scope} | {t:.4f} | {rss / 2**20:.1f} MiB | {sent:,.0f} |")
print()
g, m = rows["global"], rows["micro"]
print(f"Global over micro: step time x{g[0] / m[0]:.3f}, peak RSS x{g[1] / m[1]:.3f}, "
      f"dp bytes +{g[2] - m[2]:,.0f} per step.")
