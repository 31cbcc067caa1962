"""A mixture-of-experts laid out as torchtitan lays it out (torchtitan/distributed/
expert_parallel.py's ExpertParallel, models/llama4/parallelize.py's meshes and FSDP), on 2
ranks over gloo on the CPU, counting its own all-to-alls and timing itself; torchtitan is
not installed, so its calls are written here as it makes them.

    torchrun --nproc_per_node 2 titan_moe_train.py OUT_PREFIX [--iterations N] [--alternate]

The meshes as torchtitan's ParallelDims builds them: init_device_mesh over ("world",),
unflattened into the dense mesh ("fsdp",) and the sparse mesh ("efsdp", "ep") (efsdp = fsdp
/ ep: 1 on 2 ranks at EP 2). 2 MoE blocks of 4 experts (GroupedExperts: w1, w2, w3 of
[experts, ...]), their parameters distributed Shard(0) over the ep mesh and the blocks'
experts' forward wrapped by distribute_module with ExpertParallel's input and output
functions: `_token_dispatch` exchanges the per-expert token counts (the functional
`all_to_all_single` under no_grad, its wait_tensor) then the tokens
(`all_to_all_single_autograd` with the split sizes), `_token_combine` sends the experts'
outputs back (`all_to_all_single_autograd`, the splits swapped); the backward's all-to-alls
are autograd's. A top-2 router with a fixed bias (uneven expert loads; `--alternate`: no
bias in the odd iterations, each iteration's `balanced` says which). FSDP2
(`fully_shard`): each block's experts on the efsdp mesh, each block and the model on the
fsdp mesh.

The job writes OUT_PREFIX.rank<R>.json: its counted collectives at the ProcessGroup
(collective_truth: FSDP's; the functional ones do not pass through it), iterations with
their phases, and `moe`: per iteration the all-to-alls it issued in order (block, role,
phase, input bytes, rows to each peer): in the forward as it calls them (role `counts`,
`dispatch`, `combine`), in the backward in the order autograd ran them, each named by the
pre-hook of the forward all-to-all's autograd node that fired just before it (the
combine's first), its bytes that gradient's; the tokens its experts received and
their compute (forward)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import (
    all_to_all_single,
    all_to_all_single_autograd,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_module, distribute_tensor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from collective_truth import Truth  # noqa: E402

EXPERTS, TOP_K = 4, 2
BIAS = (0.5, 0.25, -0.1, -0.5)
LOG: dict[str, Any] = {"a2a": [], "expert_s": 0.0, "block": 0, "received": {}}


def _nb(x: torch.Tensor) -> int:
    return x.numel() * x.element_size()


def _note(block: int, role: str, phase: str, x: torch.Tensor, rows: list[int]) -> None:
    """One all-to-all about to be entered: its layer, role, bytes, rows, and when (the
    host's monotonic clock, one clock for every rank of this host)."""
    LOG["a2a"].append({"block": block, "role": role, "phase": phase, "bytes": _nb(x),
                       "rows": list(rows), "entry": time.monotonic_ns()})


def _on_grad(out: torch.Tensor, block: int, role: str, rows: list[int]) -> None:
    """The pre-hook of the autograd node of a forward all-to-all's output: autograd runs
    that node, the backward all-to-all sending this gradient with the splits swapped, right
    after. Not a hook on the output tensor: its gradient's hooks run before FSDP2's own
    hooks on the block's output (the parameters' all-gather, where the ranks wait for each
    other), so they fire milliseconds before the all-to-all is entered."""
    def hook(grad_outputs: tuple) -> None:
        _note(block, role, "backward", grad_outputs[0], rows)
    out.grad_fn.register_prehook(hook)


class ExpertParallel:
    """torchtitan's ExpertParallel: its _partition_fn, _token_dispatch, _token_combine."""

    def __init__(self) -> None:
        self.input_splits: list[int] = []
        self.output_splits: list[int] = []
        self.input_shape: Any = None
        self.permuted_indices: Any = None

    def _partition_fn(self, name: str, mod: nn.Module, device_mesh: DeviceMesh) -> None:
        for param_name, param in mod.named_parameters(recurse=False):
            mod.register_parameter(param_name, nn.Parameter(
                distribute_tensor(param, device_mesh, [Shard(0)])))

    def _token_dispatch(self, mod: nn.Module, inputs: tuple, device_mesh: DeviceMesh
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        routed_input, num_tokens_per_expert = inputs
        ep_degree = device_mesh.shape[0]
        num_local_experts = num_tokens_per_expert.shape[0] // ep_degree
        block = LOG["block"]
        with torch.no_grad():
            _note(block, "counts", "forward", num_tokens_per_expert, [])
            num_tokens_per_expert_group = all_to_all_single(
                num_tokens_per_expert, None, None, group=device_mesh.get_group())
            num_tokens_per_expert_group = torch.ops._c10d_functional.wait_tensor(
                num_tokens_per_expert_group)
            input_splits = num_tokens_per_expert.view(ep_degree, -1).sum(dim=1)
            output_splits = num_tokens_per_expert_group.view(ep_degree, -1).sum(dim=1)
            self.input_splits = input_splits.tolist()
            self.output_splits = output_splits.tolist()
        _note(block, "dispatch", "forward", routed_input, self.input_splits)
        routed_input = all_to_all_single_autograd(
            routed_input, self.output_splits, self.input_splits, device_mesh.get_group())
        _on_grad(routed_input, block, "dispatch", self.output_splits)
        (self.input_shape, routed_input, self.permuted_indices,
         num_tokens_per_expert_group) = _permute(
            routed_input, num_tokens_per_expert_group, ep_degree, num_local_experts)
        LOG["received"][block] = [int(n) for n in num_tokens_per_expert_group.tolist()]
        return routed_input, num_tokens_per_expert_group

    def _token_combine(self, mod: nn.Module, routed_output: torch.Tensor,
                       device_mesh: DeviceMesh) -> torch.Tensor:
        routed_output = _unpermute(routed_output, self.input_shape, self.permuted_indices)
        block = LOG["block"]
        _note(block, "combine", "forward", routed_output, self.output_splits)
        routed_output = all_to_all_single_autograd(
            routed_output, self.input_splits, self.output_splits, device_mesh.get_group())
        _on_grad(routed_output, block, "combine", self.input_splits)
        return routed_output

    def apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, partition_fn=self._partition_fn,
                                 input_fn=self._token_dispatch,
                                 output_fn=self._token_combine)


def _permute(x: torch.Tensor, counts: torch.Tensor, ep: int, local: int
             ) -> tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank-major rows ((e0, r0), (e1, r0), ..., (e0, r1), ...) to expert-major, and the
    tokens per local expert (torchtitan's _permute, without its alignment padding)."""
    c = counts.view(ep, local)
    starts = torch.cat([torch.zeros(1, dtype=torch.long), c.flatten().cumsum(0)[:-1]])
    starts = starts.view(ep, local)
    idx = torch.cat([torch.arange(int(starts[r, e]), int(starts[r, e] + c[r, e]))
                     for e in range(local) for r in range(ep)])
    return x.shape, x[idx], idx, c.sum(0)


def _unpermute(out: torch.Tensor, shape: Any, idx: torch.Tensor) -> torch.Tensor:
    back = out.new_empty(shape)
    back[idx] = out
    return back


class GroupedExperts(nn.Module):
    def __init__(self, d: int, h: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(EXPERTS, h, d) * d ** -0.5)
        self.w2 = nn.Parameter(torch.randn(EXPERTS, d, h) * h ** -0.5)
        self.w3 = nn.Parameter(torch.randn(EXPERTS, h, d) * d ** -0.5)

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        w1, w2, w3 = (w.to_local() if isinstance(w, DTensor) else w
                      for w in (self.w1, self.w2, self.w3))
        outs = []
        for e, xe in enumerate(x.split(num_tokens_per_expert.tolist())):
            outs.append((nn.functional.silu(xe @ w1[e].T) * (xe @ w3[e].T)) @ w2[e].T)
        y = torch.cat(outs)
        LOG["expert_s"] += time.perf_counter() - t0
        return y


class MoE(nn.Module):
    def __init__(self, d: int, block: int) -> None:
        super().__init__()
        self.block = block
        self.router = nn.Linear(d, EXPERTS, bias=False)
        self.experts = GroupedExperts(d, 2 * d)
        self.register_buffer("bias", torch.tensor(BIAS), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        LOG["block"] = self.block
        n, d = x.shape
        probs = torch.softmax(self.router(x) + self.bias, dim=1)
        w, ids = probs.topk(TOP_K, dim=1)
        num_tokens_per_expert = torch.histc(ids.flatten().float(), bins=EXPERTS, min=0,
                                            max=EXPERTS).long()
        order = ids.flatten().argsort(stable=True)
        routed = x.repeat_interleave(TOP_K, dim=0)[order]
        out = self.experts(routed, num_tokens_per_expert)
        back = torch.empty_like(out)
        back[order] = out
        return (back.view(n, TOP_K, d) * w.unsqueeze(2)).sum(1)


class Block(nn.Module):
    def __init__(self, d: int, block: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.moe = MoE(d, block)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.moe(self.norm(x))


class Model(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.layers = nn.ModuleList(Block(d, b) for b in (1, 2))
        self.out = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for b in self.layers:
            h = b(h)
        return self.out(h).pow(2).mean()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--iterations", type=int, default=6)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--d", type=int, default=64)
    p.add_argument("--alternate", action="store_true",
                   help="the odd iterations routed without the bias")
    a = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ep = 2
    # torchtitan's ParallelDims: the world mesh unflattened into the dense and sparse meshes
    world_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("world",))
    dense = world_mesh._unflatten(0, (world,), ("fsdp",))
    sparse = world_mesh._unflatten(0, (world // ep, ep), ("efsdp", "ep"))
    truth = Truth()
    torch.manual_seed(0)
    model = Model(a.d)
    for b in model.layers:
        ExpertParallel().apply(b.moe.experts, sparse["ep"])
        fully_shard(b.moe.experts, mesh=sparse["efsdp"])
        fully_shard(b, mesh=dense["fsdp"])
    fully_shard(model, mesh=dense["fsdp"])
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(a.tokens, a.d, generator=torch.Generator().manual_seed(rank))
    moe: list[dict[str, Any]] = []
    for i in range(a.iterations):
        truth.begin(i)
        LOG.update(a2a=[], expert_s=0.0, received={})
        unbiased = a.alternate and i % 2 == 1
        for b in model.layers:
            b.moe.bias.copy_(torch.zeros(EXPERTS) if unbiased else torch.tensor(BIAS))
        loss = truth.timed("forward", model, x)
        truth.timed("backward", loss.backward)
        truth.timed("update", opt.step)
        opt.zero_grad()
        truth.end()
        moe.append({"it": i, "a2a": list(LOG["a2a"]), "expert_s": LOG["expert_s"],
                    "balanced": unbiased,
                    "received": {str(b): n for b, n in LOG["received"].items()}})
    truth.dump(f"{a.out}.rank{rank}.json")
    with open(f"{a.out}.rank{rank}.json") as f:
        d = json.load(f)
    d["moe"] = moe
    # the host's monotonic clock (its entries') against the wall clock gputrace's spans
    # and the iterations are on, read together
    d["clocks"] = {"monotonic_ns": time.monotonic_ns(), "time_ns": time.time_ns()}
    d["config"] = {"world": world, "ep": ep, "experts": EXPERTS, "top_k": TOP_K,
                   "blocks": 2, "tokens": a.tokens, "d": a.d,
                   "ep_group": sparse["ep"].mesh.flatten().tolist(),
                   "efsdp_group": sparse["efsdp"].mesh.flatten().tolist(),
                   "fsdp_group": dense["fsdp"].mesh.flatten().tolist()}
    with open(f"{a.out}.rank{rank}.json", "w") as f:
        json.dump(d, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
