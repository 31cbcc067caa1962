"""A mixture-of-experts written the way most MoE code is (2 or 4 ranks over gloo on the CPU),
counting its own collectives at the ProcessGroup (collective_truth) and timing itself.

    torchrun --nproc_per_node {2,4} moe_train.py OUT_PREFIX [--iterations N] [--balanced]
        [--alternate]

2 MoE blocks, 4 experts, 2 per rank (expert-parallel groups of 2 ranks: 0+1, and 2+3 with
4 ranks, whose expert-data-parallel groups are 0+2 and 1+3); a top-2 router with a fixed
bias so the experts get uneven loads (`--balanced`: no bias; `--alternate`: no bias in the
odd iterations, each iteration's `balanced` says which). Per block, in the forward: the
per-expert token counts exchanged (an all_to_all_single of an int64 tensor of 4), the tokens
dispatched to their experts and combined back (all_to_all_single with split sizes, in an
autograd Function whose backward runs the reverse all-to-all: the combine's gradient first,
then the dispatch's). The dense parameters are under DDP (the experts' ignored by it); with
4 ranks the experts' gradients are all-reduced over the expert-data-parallel group after the
backward (in `update`).

The job writes OUT_PREFIX.rank<R>.json: its counted collectives (`calls`), iterations with
their phases, and `moe`: per iteration the all-to-alls it issued in order (block, role,
phase, its input and output bytes, rows to each peer, the seconds it stood in it, when it
entered it on the host's monotonic clock (perf_counter, one clock for the host's ranks);
the count exchanges too, role `counts`), the
tokens each expert received, its expert compute (forward), its backward compute (the
backward until the last dense gradient was accumulated, DDP's bucket ready, less the
backward all-to-alls it stood in) and its wait for DDP's gradient all-reduce (from then to
backward() returning, nothing else left to run)."""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from collective_truth import Truth  # noqa: E402

EXPERTS, PER_RANK, TOP_K = 4, 2, 2
BIAS = (0.5, 0.25, -0.1, -0.5)     # the router's fixed preference: uneven expert loads
LOG: dict[str, Any] = {"a2a": [], "expert_s": 0.0, "bwd_a2a_s": 0.0}


def a2a(x: torch.Tensor, out_rows: list[int], in_rows: list[int], group: Any,
        what: tuple[int, str, str]) -> torch.Tensor:
    """all_to_all_single with split sizes, timed and noted."""
    out = x.new_empty((sum(out_rows), *x.shape[1:]))
    t0 = time.perf_counter()
    dist.all_to_all_single(out, x.contiguous(), out_rows, in_rows, group=group)
    s = time.perf_counter() - t0
    LOG["a2a"].append({"block": what[0], "role": what[1], "phase": what[2],
                       "bytes": x.numel() * x.element_size(),
                       "bytes_out": out.numel() * out.element_size(),
                       "rows": list(in_rows), "s": s, "entry": t0})
    if what[2] == "backward":
        LOG["bwd_a2a_s"] += s
    return out


class AllToAll(torch.autograd.Function):
    """Tokens to their experts (or back); the backward sends the gradients the other way."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, out_rows: list[int], in_rows: list[int],
                group: Any, block: int, role: str) -> torch.Tensor:
        ctx.rows, ctx.group, ctx.what = (out_rows, in_rows), group, (block, role)
        return a2a(x, out_rows, in_rows, group, (block, role, "forward"))

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        out_rows, in_rows = ctx.rows
        return (a2a(g, in_rows, out_rows, ctx.group, (*ctx.what, "backward")),
                None, None, None, None, None)


class MoE(nn.Module):
    def __init__(self, d: int, ep_group: Any, ep_rank: int, balanced: bool, block: int) -> None:
        super().__init__()
        self.router = nn.Linear(d, EXPERTS, bias=False)
        nn.init.normal_(self.router.weight, std=d ** -0.5)    # logits of about unit spread
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(d, 4 * d), nn.ReLU(),
                                                   nn.Linear(4 * d, d))
                                     for _ in range(PER_RANK))
        self.bias = torch.zeros(EXPERTS) if balanced else torch.tensor(BIAS)
        self.group, self.ep_rank, self.block = ep_group, ep_rank, block
        self.received = [0] * PER_RANK

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, d = x.shape
        logits = self.router(nn.functional.layer_norm(x, (d,)))
        probs = torch.softmax(logits + self.bias, dim=1)
        w, idx = probs.topk(TOP_K, dim=1)
        flat = idx.flatten()
        order = flat.argsort(stable=True)
        tokens = x.repeat_interleave(TOP_K, dim=0)[order]     # grouped by expert
        counts = torch.bincount(flat, minlength=EXPERTS)       # this rank's, per expert
        got = torch.empty_like(counts)                          # per (source rank, expert)
        t0 = time.perf_counter()
        dist.all_to_all_single(got, counts, group=self.group)   # the count exchange
        LOG["a2a"].append({"block": self.block, "role": "counts", "phase": "forward",
                           "bytes": counts.numel() * counts.element_size(),
                           "bytes_out": got.numel() * got.element_size(), "rows": [],
                           "s": time.perf_counter() - t0, "entry": t0})
        send = counts.view(-1, PER_RANK).sum(1).tolist()        # rows to each EP rank
        recv_by = got.view(-1, PER_RANK)                         # [source rank, my expert]
        recv = recv_by.sum(1).tolist()
        h = AllToAll.apply(tokens, recv, send, self.group, self.block, "dispatch")
        t0 = time.perf_counter()
        # rows from each source, each source's grouped by my experts: regroup per expert
        parts = h.split(recv)
        outs = []
        for src, p in enumerate(parts):
            pieces = p.split(recv_by[src].tolist())
            outs.append(torch.cat([self.experts[e](pieces[e]) for e in range(PER_RANK)]))
        y = torch.cat(outs)
        LOG["expert_s"] += time.perf_counter() - t0
        for e in range(PER_RANK):
            self.received[e] += int(recv_by[:, e].sum())
        back = AllToAll.apply(y, send, recv, self.group, self.block, "combine")
        out = torch.empty_like(back)
        out[order] = back
        return x + (out.view(n, TOP_K, d) * w.unsqueeze(2)).sum(1)


class Model(nn.Module):
    def __init__(self, d: int, ep_group: Any, ep_rank: int, balanced: bool) -> None:
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.blocks = nn.ModuleList(MoE(d, ep_group, ep_rank, balanced, b) for b in (1, 2))
        self.head = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        for b in self.blocks:
            h = b(h)
        return self.head(h).pow(2).mean()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--iterations", type=int, default=8)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--d", type=int, default=64)
    p.add_argument("--balanced", action="store_true")
    p.add_argument("--alternate", action="store_true",
                   help="odd iterations routed without the bias, even ones with it")
    a = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ep = EXPERTS // PER_RANK
    ep_groups = [dist.new_group(list(range(s, s + ep))) for s in range(0, world, ep)]
    edp_groups = [dist.new_group(list(range(k, world, ep))) for k in range(ep)] \
        if world > ep else []
    truth = Truth()
    torch.manual_seed(0)           # the same dense weights and router everywhere
    model = Model(a.d, ep_groups[rank // ep], rank % ep, a.balanced)
    torch.manual_seed(100 + rank)  # each rank its own experts (their slice of 4)
    for b in model.blocks:
        for e in b.experts:
            for q in e.parameters():
                nn.init.normal_(q, std=0.05)
    experts = [n for n, _ in model.named_parameters() if ".experts." in n]
    DDP._set_params_and_buffers_to_ignore_for_model(model, experts)
    ddp = DDP(model)
    ready: list[float] = []     # when each dense gradient was accumulated (DDP's bucket)
    for n, q in model.named_parameters():
        if n not in experts:
            q.register_post_accumulate_grad_hook(lambda _: ready.append(time.perf_counter()))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    expert_params = [q for n, q in model.named_parameters() if n in experts]
    x = torch.randn(a.tokens, a.d)
    moe: list[dict[str, Any]] = []
    for i in range(a.iterations):
        truth.begin(i)
        LOG.update(a2a=[], expert_s=0.0, bwd_a2a_s=0.0)
        unbiased = a.alternate and i % 2 == 1
        for b in model.blocks:
            b.received = [0] * PER_RANK
            if a.alternate:
                b.bias = torch.zeros(EXPERTS) if unbiased else torch.tensor(BIAS)
        ready.clear()
        loss = truth.timed("forward", ddp, x)
        t0 = time.perf_counter()
        truth.timed("backward", loss.backward)
        t1 = time.perf_counter()
        wait = t1 - ready[-1] if ready else 0.0
        edp = 0.0
        if edp_groups:
            def sync() -> None:
                flat = torch.cat([q.grad.flatten() for q in expert_params])
                dist.all_reduce(flat, group=edp_groups[rank % ep])
            t2 = time.perf_counter()
            truth.timed("update", sync)
            edp = time.perf_counter() - t2
        truth.timed("update", opt.step)
        opt.zero_grad()
        truth.end()
        moe.append({"it": i, "a2a": list(LOG["a2a"]), "expert_s": LOG["expert_s"],
                    "backward_compute_s": (ready[-1] if ready else t1) - t0
                    - LOG["bwd_a2a_s"], "grad_wait_s": wait, "dense_grads": len(ready),
                    "edp_sync_s": edp, "balanced": a.balanced or unbiased,
                    "received": {f"{b.block}.{rank % ep * PER_RANK + e}": n
                                 for b in model.blocks for e, n in enumerate(b.received)}})
    truth.dump(f"{a.out}.rank{rank}.json")
    import json
    with open(f"{a.out}.rank{rank}.json") as f:
        d = json.load(f)
    d["moe"] = moe
    # the host's monotonic clock (its entries') against the wall clock gputrace's spans
    # and the iterations are on, read together
    d["clocks"] = {"monotonic_ns": time.monotonic_ns(), "time_ns": time.time_ns()}
    d["config"] = {"world": world, "ep": ep, "experts": EXPERTS, "per_rank": PER_RANK,
                   "top_k": TOP_K, "blocks": 2, "tokens": a.tokens, "d": a.d,
                   "balanced": a.balanced,
                   "ep_group": list(range(rank // ep * ep, rank // ep * ep + ep))}
    with open(f"{a.out}.rank{rank}.json", "w") as f:
        json.dump(d, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
