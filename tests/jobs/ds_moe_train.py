"""DeepSpeed-MoE as its docs write it (`deepspeed.moe.layer.MoE` blocks in a model under
`deepspeed.initialize`, then `engine(x)`, `engine.backward(loss)`, `engine.step()`), on 2
ranks over gloo on the CPU (DS_ACCELERATOR=cpu), counting its own collectives at the
ProcessGroup (collective_truth) and timing itself.

    torchrun --nproc_per_node 2 ds_moe_train.py OUT_PREFIX [--iterations N]

2 MoE blocks of 4 experts, ep_size 2 (2 experts a rank): block 1 top-1 gating, block 2
top-2 (DeepSpeed's TopKGate, capacity factor 1, tokens beyond an expert's capacity dropped,
every expert's slots padded to the capacity: the einsum dispatch, all_to_all_single with
equal splits, no count exchange). The dense parameters' gradients are all-reduced over the
data-parallel group (both ranks), the experts' over the expert-data-parallel group (each
rank alone at ep_size 2 on 2 ranks), both by the engine after the backward.

The job writes OUT_PREFIX.rank<R>.json: its counted collectives (`calls`), iterations with
their phases, and `moe`: per iteration the all-to-alls DeepSpeed's `_AllToAll` issued in
order (block, role, phase, bytes, the seconds it stood in it); the role from what ran: in
the forward, an all-to-all before the block's experts ran is the dispatch, after them the
combine; in the backward each is the gradient of the forward one whose autograd node runs
it. Per block: the capacity, the tokens each of the 4 experts was routed from this rank
(the gate's exp_counts) and the tokens dropped (beyond the capacity) and padded (the
capacity's empty slots); the experts' compute (forward).

`--keep-tokens` (drop_tokens=False): each gate all-reduces its most-loaded expert's count
(MAX) over the expert-parallel group before the dispatch, the capacity no token is dropped
under; the job notes each such all-reduce among its all-to-alls (role `capacity`)."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from deepspeed.moe import sharded_moe  # noqa: E402
from deepspeed.moe.layer import MoE  # noqa: E402
from torch import nn  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from collective_truth import Truth  # noqa: E402

EXPERTS, EP, TOPK = 4, 2, (1, 2)
LOG: dict[str, Any] = {"a2a": [], "expert_s": 0.0, "block": 0, "experts_ran": False,
                       "grad_of": None}
TRUTH: Truth | None = None


def _log_capacity() -> None:
    """The gating's all-reduce of the capacity (drop_tokens=False) noted with the
    all-to-alls, role `capacity`: the module's `dist` (deepspeed.comm) seen through a
    proxy that times its all-reduces."""
    real = sharded_moe.dist

    class Dist:
        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        def all_reduce(self, t: torch.Tensor, *args: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            out = real.all_reduce(t, *args, **kw)
            LOG["a2a"].append({"block": LOG["block"], "role": "capacity",
                               "phase": "forward", "bytes": t.numel() * t.element_size(),
                               "s": time.perf_counter() - t0, "entry": t0})
            return out

    sharded_moe.dist = Dist()


def _log_a2a() -> None:
    """DeepSpeed's _AllToAll with the job's note of each call: the class's own forward and
    backward (the same all_to_all_single on the same group), wrapped."""
    A = sharded_moe._AllToAll
    fwd, bwd = A.forward, A.backward

    def forward(ctx: Any, group: Any, x: torch.Tensor) -> torch.Tensor:
        if LOG["grad_of"] is not None:       # run by a forward all-to-all's backward
            block, role = LOG["grad_of"]
            phase = "backward"
        else:
            block, phase = LOG["block"], "forward"
            role = "combine" if LOG["experts_ran"] else "dispatch"
        ctx.what = (block, role)
        t0 = time.perf_counter()
        out = fwd(ctx, group, x)
        LOG["a2a"].append({"block": block, "role": role, "phase": phase,
                           "bytes": x.numel() * x.element_size(),
                           "s": time.perf_counter() - t0, "entry": t0})
        return out

    def backward(ctx: Any, *g: torch.Tensor) -> Any:
        LOG["grad_of"] = ctx.what
        try:
            return bwd(ctx, *g)
        finally:
            LOG["grad_of"] = None

    A.forward, A.backward = staticmethod(forward), staticmethod(backward)


class Model(nn.Module):
    def __init__(self, d: int, capacity_factor: float, drop_tokens: bool = True) -> None:
        super().__init__()
        self.inp = nn.Linear(d, d)
        expert = nn.Sequential(nn.Linear(d, 4 * d), nn.ReLU(), nn.Linear(4 * d, d))
        self.moe = nn.ModuleList(
            MoE(hidden_size=d, expert=expert, num_experts=EXPERTS, ep_size=EP, k=k,
                capacity_factor=capacity_factor, min_capacity=4, drop_tokens=drop_tokens,
                use_rts=False) for k in TOPK)
        self.head = nn.Linear(d, d)
        self.gate_out: list[tuple[Any, ...]] = []
        for b, m in enumerate(self.moe, start=1):
            experts = m.deepspeed_moe.experts
            m.register_forward_pre_hook(lambda _m, _a, b=b: LOG.update(block=b,
                                                                       experts_ran=False))
            experts.register_forward_pre_hook(lambda *_: LOG.update(t_exp=time.perf_counter()))
            experts.register_forward_hook(self._experts_done)
            m.deepspeed_moe.gate.register_forward_hook(
                lambda _m, _a, out: self.gate_out.append(out))

    @staticmethod
    def _experts_done(*_: Any) -> None:
        LOG["expert_s"] += time.perf_counter() - LOG["t_exp"]
        LOG["experts_ran"] = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        for m in self.moe:
            h = h + m(h)[0]
        return self.head(h).pow(2).mean()


def main() -> None:
    global TRUTH
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--iterations", type=int, default=6)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--d", type=int, default=64)
    p.add_argument("--capacity-factor", type=float, default=1.25)
    p.add_argument("--keep-tokens", action="store_true",
                   help="drop_tokens=False: the capacity is the most-loaded expert's count, "
                        "agreed over the group by an all-reduce of its max")
    a = p.parse_args()
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    _log_a2a()
    _log_capacity()
    torch.manual_seed(0)
    model = Model(a.d, a.capacity_factor, drop_tokens=not a.keep_tokens)
    cfg = {"train_micro_batch_size_per_gpu": a.tokens, "gradient_accumulation_steps": 1,
           "steps_per_print": 10**9, "wall_clock_breakdown": False,
           "zero_allow_untested_optimizer": True}
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    truth = TRUTH = Truth()
    x = torch.randn(a.tokens, a.d, generator=torch.Generator().manual_seed(rank))
    moe: list[dict[str, Any]] = []
    for i in range(a.iterations):
        truth.begin(i)
        LOG.update(a2a=[], expert_s=0.0)
        model.gate_out.clear()
        loss = truth.timed("forward", engine, x)
        truth.timed("backward", engine.backward, loss)
        truth.timed("update", engine.step)
        truth.end()
        blocks = {}
        for b, (k, out) in enumerate(zip(TOPK, model.gate_out, strict=True), start=1):
            cap = int(out[1])
            counts = [int(c) for c in out[-1].tolist()]    # exp_counts: routed, per expert
            kept = [min(c, cap) for c in counts]
            blocks[str(b)] = {"k": k, "capacity": cap, "routed": counts,
                              "dropped": sum(counts) - sum(kept),
                              "padded": EXPERTS * cap - sum(kept),
                              "slots": EXPERTS * cap}
        moe.append({"it": i, "a2a": list(LOG["a2a"]), "expert_s": LOG["expert_s"],
                    "blocks": blocks})
    truth.dump(f"{a.out}.rank{rank}.json")
    with open(f"{a.out}.rank{rank}.json") as f:
        d = json.load(f)
    d["moe"] = moe
    # the host's monotonic clock (its entries') against the wall clock gputrace's spans
    # and the iterations are on, read together
    d["clocks"] = {"monotonic_ns": time.monotonic_ns(), "time_ns": time.time_ns()}
    d["config"] = {"world": world, "ep": EP, "experts": EXPERTS, "top_k": list(TOPK),
                   "blocks": len(TOPK), "tokens": a.tokens, "d": a.d,
                   "capacity_factor": a.capacity_factor,
                   "ep_group": list(range(rank // EP * EP, rank // EP * EP + EP)),
                   "edp_group": list(range(rank % EP, world, EP)),
                   "capacity_top1": math.ceil(a.tokens / EXPERTS * a.capacity_factor)}
    with open(f"{a.out}.rank{rank}.json", "w") as f:
        json.dump(d, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
