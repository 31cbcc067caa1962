"""NCCL at world size 1 on one GPU, counting its own collectives (tests/jobs/collective_truth.py):
`fsdp2`, tests/jobs/fsdp_train.py's model with `fully_shard` on each block and the root;
`tp`, tests/jobs/tp_train.py's Megatron-style MLP blocks with DTensor's ColwiseParallel /
RowwiseParallel over a 1-GPU mesh.

    RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=P python nccl_job.py OUT.json
        --mode fsdp2|tp [--iterations 8] [--device cuda] [--backend nccl]

OUT.json: {"calls": every collective the process group ran (kind, bytes, iteration, phase),
"iterations": each iteration's start/end and phase seconds}. FSDP2 and DTensor
issue no collective of their own at world size 1; the job all-reduces a 256 KiB metric
(AVG) in each iteration's update, so that NCCL has a collective to run every iteration. `--device cpu --backend gloo`
tries the job without a GPU.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "jobs"))
from collective_truth import Truth  # noqa: E402
from fsdp_train import Net  # noqa: E402
from tp_train import MLP  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--mode", choices=("fsdp2", "tp"), required=True)
    p.add_argument("--iterations", type=int, default=8)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--device", default="cuda")
    p.add_argument("--backend", default="nccl")
    a = p.parse_args()
    dev = torch.device(a.device, 0) if a.device == "cuda" else torch.device(a.device)
    if dev.type == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group(a.backend, **({"device_id": dev} if dev.type == "cuda" else {}))
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(dev.type, (dist.get_world_size(),))
    torch.manual_seed(0)
    truth = Truth()
    if a.mode == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        model: nn.Module = Net(a.width, 4).to(dev)
        for b in model.blocks:
            fully_shard(b, mesh=mesh)
        fully_shard(model, mesh=mesh)
        x = torch.randn(64, 64, device=dev)
    else:
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        model = nn.Sequential(*(MLP(a.width) for _ in range(4))).to(dev)
        for b in model:
            parallelize_module(b, mesh, {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
        x = torch.randn(64, a.width, device=dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    metric = torch.ones(1 << 16, device=dev)
    avg = dist.ReduceOp.AVG if a.backend == "nccl" else dist.ReduceOp.SUM
    for i in range(a.iterations):
        truth.begin(i)
        loss = truth.timed("forward", lambda: model(x).float().pow(2).mean())
        truth.timed("backward", loss.backward)
        truth.timed("update", opt.step)
        # FSDP2 and DTensor issue no collective at world size 1 (nothing to shard across):
        # the job's own, as a user averages a metric, so that NCCL has work in every
        # iteration (AVG: NCCL's one-rank path still runs a kernel for it)
        truth.timed("update", dist.all_reduce, metric, avg)
        opt.zero_grad()
        loss.item()
        truth.end()
    with open(a.out, "w") as f:
        json.dump({"calls": truth.calls, "iterations": truth.iterations}, f)
    model = opt = loss = None
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
