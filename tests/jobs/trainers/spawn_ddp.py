"""DDP as PyTorch's DDP tutorial writes it: `python spawn_ddp.py OUT`, the processes started
with `torch.multiprocessing.spawn`, each learning its rank from its argument and calling
`init_process_group("gloo", rank=rank, world_size=2)`: no launcher variables (RANK,
WORLD_SIZE) anywhere. It times its own forward (model and loss), backward (which waits for
DDP's last buckets) and optimizer step with perf_counter, and writes OUT.rank<R>.json
(own_clock) with DDP's buckets."""

from __future__ import annotations

import gc
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from own_clock import OwnClock, blocks_model, dataset, ddp_buckets
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

STEPS = 20


def setup(rank: int, world_size: int) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    dist.init_process_group("gloo", rank=rank, world_size=world_size)


def train(rank: int, world_size: int, out: str) -> None:
    setup(rank, world_size)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = DDP(blocks_model(), bucket_cap_mb=0.5)
    loss_fn = torch.nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    ds = dataset(64 * STEPS * world_size)
    loader = DataLoader(ds, batch_size=64, sampler=DistributedSampler(ds))
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
    clock.extra["buckets"] = ddp_buckets(model)
    clock.write(out, rank)
    # DDP's reducer holds its last works: freed on this thread before gloo goes (see
    # tests/jobs/ddp_grads.py)
    model = opt = loss = None
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    os.environ["MASTER_PORT"] = str(free_port())
    mp.spawn(train, args=(2, sys.argv[1]), nprocs=2, join=True)
