"""A tensor-parallel job profiled by PyTorch's own profiler, as a user without gputrace
profiles one: Megatron-style MLP blocks (w1 ColwiseParallel, w2 RowwiseParallel) over a
DeviceMesh of its ranks with DTensor's `parallelize_module`, each iteration a
`ProfilerStep#N` (torch.profiler's schedule), the trace exported per rank:

    torchrun --nproc_per_node 2 tp_kineto.py OUT_DIR [--iterations N]

writes OUT_DIR/rank<R>.json (Kineto JSON) and, beside the directory, OUT_DIR.group.rank<R>.json:
the TP group's name, description and ranks as the job sees them."""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)
from torch.profiler import ProfilerActivity, profile, schedule
from tp_train import MLP  # the same Megatron block as the recorded TP job


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--iterations", type=int, default=5)
    a = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    model = nn.Sequential(*[MLP(64) for _ in range(2)])
    for b in model:
        parallelize_module(b, mesh, {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(32, 64)
    os.makedirs(a.out, exist_ok=True)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True,
                 schedule=schedule(wait=0, warmup=1, active=a.iterations - 1),
                 on_trace_ready=lambda prof: prof.export_chrome_trace(
                     os.path.join(a.out, f"rank{rank}.json"))) as prof:
        for _ in range(a.iterations):
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            prof.step()
    g = mesh.get_group()
    with open(f"{a.out.rstrip('/')}.group.rank{rank}.json", "w") as f:
        json.dump({"name": g.group_name, "desc": getattr(g, "group_desc", None),
                   "ranks": dist.get_process_group_ranks(g)}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
