#!/usr/bin/python3
"""PyTorch's own torch.distributed (Gloo) collectives, same protocol as main.cpp.

Launches --world-size processes on 127.0.0.1 (1 torch thread each) and writes
{"impl": "torch", "rows": [...], "unsupported": {...}} to --out. torch 1.13's
Gloo group has no reduce_scatter and no flat all_gather: all_gather uses the
list API, and reduce_scatter is recorded as unsupported; the usual workaround,
all_reduce then slice, is measured as "reduce_scatter (all_reduce+slice)".
"""
import argparse, json, os, subprocess, sys, time


def parse_size(s):
    mult = {"K": 1024, "M": 1024 ** 2}
    return int(s[:-1]) * mult[s[-1]] if s[-1] in mult else int(s)


def make_op(op, nbytes, world, torch, dist):
    numel = nbytes // 4
    per = numel // world
    if op == "all_reduce":
        t = torch.zeros(numel)
        return lambda: dist.all_reduce(t)
    if op == "all_gather":
        inp, out = torch.zeros(per), [torch.empty(per) for _ in range(world)]
        return lambda: dist.all_gather(out, inp)
    if op == "reduce_scatter":
        inp, out = [torch.zeros(per) for _ in range(world)], torch.empty(per)
        return lambda: dist.reduce_scatter(out, inp)
    if op == "reduce_scatter (all_reduce+slice)":
        t, rank = torch.zeros(per * world), dist.get_rank()
        return lambda: (dist.all_reduce(t), t[rank * per:(rank + 1) * per].clone())
    if op == "broadcast":
        t = torch.zeros(numel)
        return lambda: dist.broadcast(t, 0)
    raise ValueError(op)


def worker(a):
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://")
    world, rank = dist.get_world_size(), dist.get_rank()
    rows, unsupported = [], {}
    for op in a.ops.split(","):
        for nbytes in [parse_size(s) for s in a.sizes.split(",")]:
            fn = make_op(op, nbytes, world, torch, dist)
            try:
                fn()
            except Exception as e:  # noqa: BLE001 - record what torch says
                unsupported[op] = f"{type(e).__name__}: {e}".splitlines()[0]
                dist.barrier()
                break
            for _ in range(5):
                fn()
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(3):
                fn()
            est = (time.perf_counter() - t0) / 3
            it = torch.tensor([int(min(5000, max(5, a.target_s / max(est, 1e-9))))])
            dist.all_reduce(it, op=dist.ReduceOp.MAX)
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(int(it.item())):
                fn()
            dt = torch.tensor([(time.perf_counter() - t0) / int(it.item())], dtype=torch.float64)
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            rows.append({"op": op, "bytes": nbytes, "sec_per_op": dt.item()})
            if rank == 0:
                print(f"{op} {nbytes} B: {dt.item() * 1e6:.1f} us", flush=True)
    if rank == 0:
        with open(a.out, "w") as f:
            json.dump({"impl": "torch", "world_size": world, "rows": rows, "unsupported": unsupported}, f)
    dist.barrier()


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--sizes", default="4K,64K,1M,16M,64M")
    p.add_argument("--ops", default="all_reduce,all_gather,reduce_scatter,reduce_scatter (all_reduce+slice),broadcast")
    p.add_argument("--target-s", type=float, default=0.3)
    p.add_argument("--port", type=int, default=29533)
    p.add_argument("--out", required=True)
    p.add_argument("--_worker", action="store_true")
    a = p.parse_args()
    if a._worker:
        return worker(a)
    procs = []
    for r in range(a.world_size):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(a.world_size), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(a.port), GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1",
                   OPENBLAS_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, __file__, "--_worker"] + sys.argv[1:], env=env))
    return max(p.wait() for p in procs)


if __name__ == "__main__":
    sys.exit(main())
