#!/usr/bin/python3
"""PyTorch's own DDP (Gloo) on the model of bench/ddp/main.cpp (mlp), the peer
to compare with in one run. 4 x Linear(1024, 1024) with ReLU, MSE against a
random target, SGD(lr=0.01), --batch samples per rank, 1 torch thread per
rank. With --world-size 1: no DDP (the single-process baseline). Writes one
JSON object: mean step time over the timed steps, max over ranks."""
import argparse, json, os, subprocess, sys, time


def worker(a):
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world > 1:
        dist.init_process_group("gloo", init_method="env://")
    torch.manual_seed(0)
    layers = []
    for i in range(4):
        layers.append(torch.nn.Linear(1024, 1024))
        if i != 3:
            layers.append(torch.nn.ReLU())
    model = torch.nn.Sequential(*layers)
    torch.manual_seed(100 + rank)
    x, y = torch.randn(a.batch, 1024), torch.randn(a.batch, 1024)
    net = torch.nn.parallel.DistributedDataParallel(model) if world > 1 else model
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step():
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x), y).backward()
        opt.step()

    for _ in range(a.warmup):
        step()
    if world > 1:
        dist.barrier()
    t0 = time.perf_counter()
    for _ in range(a.steps):
        step()
    t = torch.tensor([(time.perf_counter() - t0) / a.steps], dtype=torch.float64)
    if world > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    if rank == 0:
        out = {"impl": "torch", "model": "mlp", "world_size": world, "batch_per_rank": a.batch,
               "step_time_s": t.item(), "samples_per_s": a.batch * world / t.item()}
        print(json.dumps(out), flush=True)
        if a.out:
            json.dump(out, open(a.out, "w"))


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--port", type=int, default=29541)
    p.add_argument("--out", default="")
    p.add_argument("--_worker", action="store_true")
    a = p.parse_args()
    if a._worker:
        return worker(a)
    procs = [subprocess.Popen([sys.executable, __file__, "--_worker"] + sys.argv[1:],
                              env=dict(os.environ, RANK=str(r), WORLD_SIZE=str(a.world_size),
                                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(a.port),
                                       GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1"))
             for r in range(a.world_size)]
    return max(p.wait() for p in procs)


if __name__ == "__main__":
    sys.exit(main())
