#!/usr/bin/python3
"""Eager PyTorch GPT-2 (Debian's python3-torch), the speed peer of meshtrain's
--model gpt2: the textbook GPT-2 (fused q/k/v, tanh GELU, tied head, the padded
vocabulary's logits left out of the softmax) started from an llm.c checkpoint
and trained with torch.optim.AdamW on an llm.c token shard in file order.
Prints one JSON line: the per-step losses and seconds."""
import argparse, json, math, time

import numpy as np
import torch
import torch.nn.functional as F


def load_llmc(path):
    header = np.fromfile(path, dtype=np.int32, count=256)
    assert header[0] == 20240326 and header[1] == 3, "an llm.c fp32 checkpoint (magic 20240326, version 3)"
    maxT, V, L, NH, C, Vp = (int(x) for x in header[2:8])
    shapes = [("wte", (Vp, C)), ("wpe", (maxT, C)), ("ln1w", (L, C)), ("ln1b", (L, C)), ("qkvw", (L, 3 * C, C)),
              ("qkvb", (L, 3 * C)), ("attprojw", (L, C, C)), ("attprojb", (L, C)), ("ln2w", (L, C)), ("ln2b", (L, C)),
              ("fcw", (L, 4 * C, C)), ("fcb", (L, 4 * C)), ("fcprojw", (L, C, 4 * C)), ("fcprojb", (L, C)),
              ("lnfw", (C,)), ("lnfb", (C,))]
    data = np.fromfile(path, dtype=np.float32, offset=1024)
    params, at = {}, 0
    for name, shape in shapes:
        n = int(np.prod(shape))
        params[name] = torch.nn.Parameter(torch.from_numpy(data[at:at + n].reshape(shape).copy()))
        at += n
    return dict(V=V, L=L, NH=NH, C=C), params


def forward(p, m, tokens):
    B, T = tokens.shape
    C, NH, L = m["C"], m["NH"], m["L"]
    x = p["wte"][tokens] + p["wpe"][:T]
    for i in range(L):
        h = F.layer_norm(x, (C,), p["ln1w"][i], p["ln1b"][i])
        q, k, v = F.linear(h, p["qkvw"][i], p["qkvb"][i]).split(C, dim=2)
        q, k, v = (t.view(B, T, NH, C // NH).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(C // NH)
        att = att.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, C)
        x = x + F.linear(y, p["attprojw"][i], p["attprojb"][i])
        h = F.layer_norm(x, (C,), p["ln2w"][i], p["ln2b"][i])
        x = x + F.linear(F.gelu(F.linear(h, p["fcw"][i], p["fcb"][i]), approximate="tanh"), p["fcprojw"][i],
                         p["fcprojb"][i])
    h = F.layer_norm(x, (C,), p["lnfw"], p["lnfb"])
    return (h @ p["wte"].t())[..., :m["V"]]


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("checkpoint")
    ap.add_argument("shard")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    m, p = load_llmc(a.checkpoint)
    tokens = torch.from_numpy(np.fromfile(a.shard, dtype=np.uint16, offset=1024).astype(np.int64))
    opt = torch.optim.AdamW(list(p.values()), lr=a.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    B, T, losses, seconds = a.batch, a.seq_len, [], []
    for step in range(a.steps):
        at = (step * B * T) % (len(tokens) - B * T - 1)
        window = tokens[at:at + B * T + 1]
        x, y = window[:-1].view(B, T), window[1:].view(B, T)
        t0 = time.perf_counter()
        loss = F.cross_entropy(forward(p, m, x).reshape(-1, m["V"]), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        seconds.append(time.perf_counter() - t0)
        losses.append(loss.item())
    print(json.dumps({"losses": losses, "step_seconds": seconds, "tokens_per_step": B * T}))


if __name__ == "__main__":
    main()
