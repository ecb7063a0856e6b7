#!/usr/bin/python3
"""An independent reference for meshtrain's GPT: the same architecture written
here in PyTorch (Python, Debian's python3-torch), started from the parameters
bench_reference_export wrote, trained on the same batches with torch.optim, its
losses compared with meshtrain's --metrics-out. Not a copy of meshtrain's code:
the model below is the textbook pre-LayerNorm GPT (GPT-2's block)."""
import argparse, json, math, os, sys

import numpy as np
import torch
import torch.nn.functional as F


def load(d, name, shape, dtype=np.float32):
    a = np.fromfile(os.path.join(d, name), dtype=dtype)
    return torch.from_numpy(a.reshape(shape).copy())


def forward(p, m, tokens):
    B, T = tokens.shape
    H, nh = m["hidden"], m["heads"]
    x = p["embed.tok.weight"][tokens] + p["embed.pos"][:T]
    causal = torch.ones(T, T, dtype=torch.bool).triu(1)
    for i in range(m["layers"]):
        b = lambda n: p[f"blocks.{i}.{n}"]
        h = F.layer_norm(x, (H,), b("ln1.weight"), b("ln1.bias"))
        q, k, v = (F.linear(h, b(f"{n}.weight"), b(f"{n}.bias")).view(B, T, nh, H // nh).transpose(1, 2)
                   for n in ("q", "k", "v"))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(H // nh)
        y = att.masked_fill(causal, float("-inf")).softmax(-1) @ v
        x = x + F.linear(y.transpose(1, 2).reshape(B, T, H), b("proj.weight"), b("proj.bias"))
        h = F.layer_norm(x, (H,), b("ln2.weight"), b("ln2.bias"))
        x = x + F.linear(F.gelu(F.linear(h, b("fc1.weight"), b("fc1.bias"))), b("fc2.weight"), b("fc2.bias"))
    h = F.layer_norm(x, (H,), p["head.ln.weight"], p["head.ln.bias"])
    head = p["embed.tok.weight"] if m["tie_embeddings"] else p["head.out.weight"]
    return h @ head.t()


def learning_rate(c, step):
    if step < c["warmup_steps"]:
        return c["lr"] * (step + 1) / c["warmup_steps"]
    if c["lr_schedule"] == "constant":
        return c["lr"]
    span = max(1, c["steps"] - c["warmup_steps"] - 1)
    progress = min(1.0, (step - c["warmup_steps"]) / span)
    return c["lr"] * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("export_dir")
    ap.add_argument("metrics", help="meshtrain's --metrics-out of the same flags")
    a = ap.parse_args()
    torch.set_num_threads(1)
    index = json.load(open(os.path.join(a.export_dir, "index.json")))
    c, m = index["config"], index["config"]["model"]
    p = {e["name"]: torch.nn.Parameter(load(a.export_dir, e["name"] + ".bin", e["shape"])) for e in index["parameters"]}
    shape = [int(s) for s in index["batch_shape"]]
    inputs = load(a.export_dir, "inputs.bin", shape, np.int64)
    targets = load(a.export_dir, "targets.bin", shape, np.int64)
    params = list(p.values())
    if c["optimizer"] == "adamw":
        opt = torch.optim.AdamW(params, lr=c["lr"], eps=c["adam_eps"], weight_decay=c["weight_decay"])
    elif c["optimizer"] == "adam":
        opt = torch.optim.Adam(params, lr=c["lr"], eps=c["adam_eps"], weight_decay=c["weight_decay"])
    else:
        opt = torch.optim.SGD(params, lr=c["lr"], momentum=c["momentum"], weight_decay=c["weight_decay"])
    mine = json.load(open(a.metrics))["losses"]
    g = c["global_batch"]
    print(f"{'step':>4} {'meshtrain':>10} {'PyTorch':>10} {'|difference|':>13}")
    worst = 0.0
    for step in range(c["steps"]):
        for group in opt.param_groups:
            group["lr"] = learning_rate(c, step)
        opt.zero_grad()
        x, y = inputs[step * g:(step + 1) * g], targets[step * g:(step + 1) * g]
        logits = forward(p, m, x)
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
        loss.backward()
        opt.step()
        diff = abs(loss.item() - mine[step])
        worst = max(worst, diff)
        print(f"{step:>4} {mine[step]:>10.6f} {loss.item():>10.6f} {diff:>13.2e}")
    print(f"largest |difference| over {c['steps']} steps: {worst:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
