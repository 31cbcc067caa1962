"""Tensor parallelism as PyTorch's TP tutorial writes it: Megatron-style MLP blocks (w1
ColwiseParallel, w2 RowwiseParallel) over a DeviceMesh, with DTensor's `parallelize_module`;
with `--fsdp` a 2-D mesh ("dp", "tp"), each block and the root sharded with FSDP2 over "dp"
(torchtitan's FSDP x TP):

    torchrun --nproc_per_node 2 tp_train.py OUT [--iterations N]
    torchrun --nproc_per_node 4 tp_train.py OUT --fsdp

It counts its own collectives (c10d's at the ProcessGroup: collective_truth; the functional
ones DTensor issues, and the time its thread stood in them, from PyTorch's profiler:
comm_clock: kind, bytes, and the block, 1..L from the input side, each belongs to) and times
its phases, and writes OUT.rank<R>.json: {"iterations", "calls" (c10d's), "functional"
(DTensor's: comm_clock), "stood" (seconds per iteration and phase in the functional ones)}.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from collective_truth import Truth  # noqa: E402
from comm_clock import CommClock  # noqa: E402


class MLP(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(d, 4 * d)
        self.w2 = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.w2(torch.relu(self.w1(x)))


class Net(nn.Module):
    """The blocks in a row, each marked for the job's clock (its forward a profiler range,
    its input and output edges where the backward leaves markers)."""

    def __init__(self, d: int, blocks: int, clock: CommClock) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(MLP(d) for _ in range(blocks))
        self.clock = clock

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for k, b in enumerate(self.blocks, 1):
            x = self.clock.edge(x, k, "in")
            with self.clock.block(k):
                x = b(x)
            x = self.clock.edge(x, k, "out")
        return x


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--iterations", type=int, default=12)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--blocks", type=int, default=6)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--fsdp", action="store_true")
    a = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if a.fsdp:
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
        tp, dp = mesh["tp"], mesh["dp"]
    else:
        tp = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        dp = None
    torch.manual_seed(0)
    truth, clock = Truth(), CommClock()
    model = Net(a.width, a.blocks, clock)
    for b in model.blocks:
        parallelize_module(b, tp, {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
    if dp is not None:
        from torch.distributed.fsdp import fully_shard

        for b in model.blocks:
            fully_shard(b, mesh=dp)
        fully_shard(model, mesh=dp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    # the same batch on the ranks of a TP group; another on each data-parallel rank
    g = torch.Generator().manual_seed(dp.get_local_rank() if dp is not None else 0)
    x = torch.randn(a.batch, a.width, generator=g)
    with clock:
        for i in range(a.iterations):
            truth.begin(i)
            with clock.iteration(i):
                with clock.phase("forward"):
                    loss = truth.timed("forward", lambda: model(x).pow(2).mean())
                with clock.phase("backward"):
                    truth.timed("backward", loss.backward)
                with clock.phase("update"):
                    truth.timed("update", opt.step)
                opt.zero_grad()
            truth.end()
    with open(f"{a.out}.rank{rank}.json", "w") as f:
        json.dump({"calls": truth.calls, "iterations": truth.iterations, **clock.dump()}, f)
    model = opt = loss = None
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
