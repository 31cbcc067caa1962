"""A small sharded-data-parallel training job (2 ranks over gloo on the CPU) that counts its
own collectives and times its own iterations and phases.

    torchrun --nproc_per_node 2 fsdp_train.py OUT_PREFIX
        --mode fsdp2|fsdp2-keep|fsdp2-prefetch|fsdp2-hsdp|fsdp1 [--iterations N] [--width D]
        [--blocks B]

fsdp2: `fully_shard` on each block and the root (reshard_after_forward=True); fsdp2-keep:
the same with reshard_after_forward=False; fsdp2-prefetch: resharding, each block
prefetching the next in forward and the previous in backward, all-gathers asynchronous
(FSDP waits for each in the unit's pre-forward/pre-backward); fsdp2-hsdp: HSDP on a 2x1
mesh (replicated across the ranks, sharded over one: gradients all-reduced); fsdp1: FullyShardedDataParallel wrapped per
block. Each rank writes OUT_PREFIX.rank<R>.json: every collective the process group ran
(collective_truth: kind, input bytes, iteration, phase) and each iteration's start/end
(time.time_ns) and forward/backward/update seconds (perf_counter).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from collective_truth import Truth  # noqa: E402


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


class Net(nn.Module):
    def __init__(self, d: int, blocks: int) -> None:
        super().__init__()
        self.inp = nn.Linear(64, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(blocks))
        self.head = nn.Linear(d, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def shard(model: Net, mode: str) -> nn.Module:
    if mode.startswith("fsdp2"):
        from torch.distributed.fsdp import fully_shard

        keep = mode == "fsdp2-keep"
        mesh = None
        if mode == "fsdp2-hsdp":   # replicated across the 2 ranks, sharded over 1
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
        for b in model.blocks:
            fully_shard(b, reshard_after_forward=not keep, mesh=mesh)
        fully_shard(model, reshard_after_forward=not keep, mesh=mesh)
        if mode == "fsdp2-prefetch":
            blocks = list(model.blocks)
            for prev, nxt in zip(blocks, blocks[1:], strict=False):
                prev.set_modules_to_forward_prefetch([nxt])
                nxt.set_modules_to_backward_prefetch([prev])
            model._set_unshard_async_op(True)
        return model
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    return FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({Block}),
                                    device_id=torch.device("cpu"))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--mode", default="fsdp2", choices=("fsdp2", "fsdp2-keep", "fsdp2-prefetch", "fsdp2-hsdp", "fsdp1"))
    p.add_argument("--iterations", type=int, default=10)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--batch", type=int, default=64)
    a = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = shard(Net(a.width, a.blocks), a.mode)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(a.batch, 64, generator=g)
    y = torch.randint(0, 10, (a.batch,), generator=g)
    truth = Truth()
    for i in range(a.iterations):
        truth.begin(i)
        loss = truth.timed("forward", lambda: loss_fn(model(x), y))
        truth.timed("backward", loss.backward)
        truth.timed("update", opt.step)
        opt.zero_grad()
        truth.end()
    truth.dump(f"{a.out}.rank{rank}.json")
    model = opt = loss = None   # the last collectives' works, on this thread (ddp_grads.py)
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
