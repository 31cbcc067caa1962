"""DDP over gloo that forks a child after every step, as a job does whose DataLoader starts
its workers for each pass over the data (or each validation), counting its own children that
never got going.

    torchrun --nproc_per_node 2 fork_after_step.py OUT_PREFIX [--steps N]

Each step: an asynchronous all-reduce of the last step's loss the job waits on, forward and
backward of a small DDP model (one gradient bucket), its optimizer step, then os.fork(): the child
exits at once; the parent waits for it up to 2 s, then counts it hung and kills it. Writes
OUT_PREFIX.rank<R>.json: steps, the all-reduces it issued asynchronously, hung children."""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--steps", type=int, default=300)
    a = p.parse_args()
    dist.init_process_group("gloo")
    model = DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8)),
        bucket_cap_mb=0.01)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(16, 64)
    hung = issued = 0
    metric = torch.zeros(1)
    for _ in range(a.steps):
        dist.all_reduce(metric, async_op=True).wait()    # the last step's loss, logged
        issued += 1
        loss = model(x).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        metric = loss.detach().reshape(1)
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        deadline = time.monotonic() + 2.0
        while not os.waitpid(pid, os.WNOHANG)[0]:
            if time.monotonic() > deadline:
                hung += 1
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                break
            time.sleep(0.002)
    rank = dist.get_rank()
    with open(f"{a.out}.rank{rank}.json", "w") as f:
        json.dump({"steps": a.steps, "async_all_reduces": issued, "hung": hung}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
