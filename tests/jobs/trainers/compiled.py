"""A loop over a `torch.compile`d model, or with `--ddp` (under torchrun, gloo) over
`torch.compile(DDP(model))` as torch.compile's docs recommend for DDP (DDPOptimizer splits the
graph at the buckets); `--compiled-autograd` compiles the backward too (DDP's python reducer:
a functional all-reduce per gradient, no buckets):

    python compiled.py OUT
    torchrun --nproc_per_node 2 compiled.py OUT --ddp [--compiled-autograd]

It times its forward (model and loss), backward (which waits for DDP's last buckets) and the
optimizer's step with perf_counter, after the compiling iterations, and writes
OUT.rank<R>.json (own_clock) with DDP's buckets and the bytes of the model's gradients."""

from __future__ import annotations

import argparse
import gc
import time

import torch
import torch.distributed as dist
from own_clock import OwnClock, blocks_model, dataset, ddp_buckets


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--ddp", action="store_true")
    p.add_argument("--compiled-autograd", action="store_true")
    p.add_argument("--steps", type=int, default=20)
    a = p.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    rank = 0
    net = blocks_model()
    if a.compiled_autograd:
        torch._dynamo.config.compiled_autograd = True
        torch._dynamo.config.optimize_ddp = "python_reducer"
    if a.ddp:
        dist.init_process_group("gloo")
        rank = dist.get_rank()
        ddp = torch.nn.parallel.DistributedDataParallel(net, bucket_cap_mb=1)
        model = torch.compile(ddp)
    else:
        model = torch.compile(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    loader = torch.utils.data.DataLoader(dataset(64 * a.steps), batch_size=64)
    clock = OwnClock()
    now = time.perf_counter
    for x, y in loader:
        clock.fed(len(x))
        opt.zero_grad()
        t0 = now()
        loss = loss_fn(model(x), y)
        t1 = now()
        loss.backward()
        t2 = now()
        opt.step()
        t3 = now()
        clock.add("forward", t1 - t0)
        clock.add("backward", t2 - t1)
        clock.add("update", t3 - t2)
        clock.step_done()
    clock.extra["grad_bytes"] = sum(p.numel() * p.element_size() for p in net.parameters())
    if a.ddp and not a.compiled_autograd:
        clock.extra["buckets"] = ddp_buckets(ddp)
    clock.write(a.out, rank)
    if a.ddp:   # DDP's reducer holds its last works: freed before gloo goes
        model = ddp = opt = loss = None
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
