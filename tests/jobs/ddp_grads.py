"""2-rank gloo DDP of a small model with one parameter per bucket: after each backward,
rank 0 writes the gradients DDP left on every parameter (the ranks' average) to argv[1] as
JSON, so that a run under `gputrace record` can be held against a plain one: gputrace
times DDP's buckets with a comm hook of its own in place of DDP's default, and the training
must not see the difference."""

from __future__ import annotations

import gc
import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                          nn.Linear(16, 4))
    # a bucket per parameter or two: several buckets, each all-reduced on its own
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.0005)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(100 + rank)   # each rank its own data
    grads = []
    for _ in range(int(os.environ.get("ITERATIONS", "4"))):
        x, y = torch.randn(32, 8, generator=g), torch.randn(32, 4, generator=g)
        loss = nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        grads.append([p.grad.flatten().tolist() for p in model.parameters()])
        opt.step()
        opt.zero_grad()
    if rank == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(grads, f)
    # The works of a backward's all-reduces hold a Python object of torch's (the backward's
    # contextvars): a gloo thread that drops the last reference to one while the
    # interpreter exits aborts the process ("terminate called without an active
    # exception"), which a barrier holding them as its prior works made happen now and
    # then. DDP's reducer keeps each bucket's last work: freed here, on this thread.
    ddp = opt = loss = None
    gc.collect()
    dist.barrier()   # gloo aborts a rank that tears down while the other still talks
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
