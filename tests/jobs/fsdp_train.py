"""A small sharded-data-parallel training job (2 ranks over gloo on the CPU) that counts its
own collectives and times its own iterations and phases.

    torchrun --nproc_per_node 2 fsdp_train.py OUT_PREFIX
        --mode fsdp2|fsdp2-keep|fsdp2-prefetch|fsdp2-hsdp|fsdp1 [--iterations N] [--width D]
        [--blocks B] [--forward-prefetch N] [--backward-prefetch N] [--keep NAMES]
        [--bf16] [--async-unshard]

fsdp2: `fully_shard` on each block and the root (reshard_after_forward=True); fsdp2-keep:
the same with reshard_after_forward=False; fsdp2-prefetch: resharding, each block
prefetching the next in forward and the previous in backward, all-gathers asynchronous
(FSDP waits for each in the unit's pre-forward/pre-backward); fsdp2-hsdp: HSDP on a 2x1
mesh (replicated across the ranks, sharded over one: gradients all-reduced); fsdp1:
FullyShardedDataParallel wrapped per block.

FSDP2's settings, set as a user sets them (fsdp2 and fsdp2-keep): --forward-prefetch N, each
block `set_modules_to_forward_prefetch` with the N blocks after it; --backward-prefetch N,
`set_modules_to_backward_prefetch` with the N blocks before it (0: FSDP2's default, no
call); --keep NAMES, `reshard_after_forward=False` for those modules (comma separated,
`root` the root) and True for the others; --bf16, MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=float32); --async-unshard, the all-gathers asynchronous.

Each rank writes OUT_PREFIX.rank<R>.json: every collective the process group ran
(collective_truth: kind, input bytes, iteration, phase), each iteration's start/end
(time.time_ns) and forward/backward/update seconds (perf_counter), and under FSDP2 the
settings it gave each module (`config`: module name, "" for the root -> forward_prefetch,
backward_prefetch (module names; null: FSDP2's default), reshard_after_forward,
param_dtype, reduce_dtype) and each synchronous all-gather call it timed itself (`gathers`:
iteration, phase, start and end in time.time_ns).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

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


def shard(model: Net, a: argparse.Namespace) -> tuple[nn.Module, dict[str, dict]]:
    """The model sharded as `a` says, and under FSDP2 the settings given each module."""
    mode = a.mode
    config: dict[str, dict] = {}
    if mode.startswith("fsdp2"):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(torch.bfloat16, torch.float32) if a.bf16 else \
            MixedPrecisionPolicy()
        keep_names = {n.strip() for n in a.keep.split(",") if n.strip()}
        mesh = None
        if mode == "fsdp2-hsdp":   # replicated across the 2 ranks, sharded over 1
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
        names = [f"blocks.{i}" for i in range(len(model.blocks))]

        def reshard(name: str) -> bool:
            return not (mode == "fsdp2-keep" or name in keep_names
                        or (name == "" and "root" in keep_names))

        for name, b in zip(names, model.blocks, strict=True):
            fully_shard(b, reshard_after_forward=reshard(name), mesh=mesh, mp_policy=mp)
        fully_shard(model, reshard_after_forward=reshard(""), mesh=mesh, mp_policy=mp)
        blocks = list(model.blocks)
        fwd = a.forward_prefetch or (1 if mode == "fsdp2-prefetch" else 0)
        bwd = a.backward_prefetch or (1 if mode == "fsdp2-prefetch" else 0)
        for name in ["", *names]:
            config[name] = {"forward_prefetch": [], "backward_prefetch": None,
                            "reshard_after_forward": reshard(name),
                            "param_dtype": "bfloat16" if a.bf16 else None,
                            "reduce_dtype": "float32" if a.bf16 else None}
        for i, b in enumerate(blocks):
            after = names[i + 1:i + 1 + fwd]
            before = names[max(i - bwd, 0):i][::-1]   # nearest first, as backward runs
            if after:
                b.set_modules_to_forward_prefetch([blocks[names.index(n)] for n in after])
                config[names[i]]["forward_prefetch"] = after
            if before:
                b.set_modules_to_backward_prefetch([blocks[names.index(n)] for n in before])
                config[names[i]]["backward_prefetch"] = before
        if mode == "fsdp2-prefetch" or a.async_unshard:
            model._set_unshard_async_op(True)
        return model, config
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    return FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({Block}),
                                    device_id=torch.device("cpu")), config


def time_gathers(truth: Truth) -> list[dict]:
    """The job's own clock on each synchronous all-gather call (FSDP's parameter gathers):
    iteration, phase, start and end (time.time_ns), from a wrapper of torch.distributed's
    function FSDP calls."""
    out: list[dict] = []
    for name in ("all_gather_single", "all_gather_into_tensor"):
        orig = getattr(dist, name, None)
        if orig is None:
            continue

        def timed(*a, _orig=orig, **k):
            t0 = time.time_ns()
            res = _orig(*a, **k)
            if not k.get("async_op"):
                out.append({"it": truth.iteration, "phase": truth.phase, "t": t0,
                            "end": time.time_ns()})
            return res

        setattr(dist, name, timed)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--mode", default="fsdp2", choices=("fsdp2", "fsdp2-keep", "fsdp2-prefetch", "fsdp2-hsdp", "fsdp1"))
    p.add_argument("--iterations", type=int, default=10)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--forward-prefetch", type=int, default=0)
    p.add_argument("--backward-prefetch", type=int, default=0)
    p.add_argument("--keep", default="", help="modules with reshard_after_forward=False")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--async-unshard", action="store_true")
    a = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model, config = shard(Net(a.width, a.blocks), a)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(a.batch, 64, generator=g)
    y = torch.randint(0, 10, (a.batch,), generator=g)
    truth = Truth()
    gathers = time_gathers(truth)
    for i in range(a.iterations):
        truth.begin(i)
        loss = truth.timed("forward", lambda: loss_fn(model(x), y))
        truth.timed("backward", loss.backward)
        truth.timed("update", opt.step)
        opt.zero_grad()
        truth.end()
    truth.dump(f"{a.out}.rank{rank}.json")
    if config:   # the settings given each module, beside the job's own count
        path = f"{a.out}.rank{rank}.json"
        with open(path) as f:
            d = json.load(f)
        d["config"] = config
        d["gathers"] = gathers
        with open(path, "w") as f:
            json.dump(d, f)
    model = opt = loss = None   # the last collectives' works, on this thread (ddp_grads.py)
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
