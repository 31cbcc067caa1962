"""An MoE-like exchange (2 ranks over gloo on the CPU) that issues its collectives itself,
counts them at the ProcessGroup (collective_truth) and times its own waits.

    torchrun --nproc_per_node 2 moe_exchange.py OUT_PREFIX [--iterations N] [--hot F]

Per iteration, in forward: the routing counts all-gathered (dist.all_gather), a scale
broadcast from rank 0 (dist.broadcast), the tokens sent to their experts and back
(dist.all_to_all of per-rank lists, then an async dist.all_to_all_single the job waits on
after some compute; with `--hot F`, a hot expert: every rank routes the share F of its tokens
to rank 0's expert, which then receives, and sends back, more than the others, the tokens
sent with dist.all_to_all_single and its split sizes); in backward:
nothing (autograd only); in update: the expert gradients
all-reduced asynchronously (async_op=True, waited at once; rank 1 joins 50 ms late, so
rank 0 stands in its wait) and a send/recv pair between the
two ranks. The job writes OUT_PREFIX.rank<R>.json with its counted collectives, iterations
and each wait() it timed (time.time_ns around the call; `running`: the work had not
completed when the wait began).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from collective_truth import Truth  # noqa: E402


class MoE(nn.Module):
    """Route tokens to one expert per rank: the exchange runs inside the model's forward."""

    def __init__(self, d: int, truth: Truth, hot: float | None = None) -> None:
        super().__init__()
        self.world = dist.get_world_size()
        self.router = nn.Linear(d, self.world)
        self.expert = nn.Sequential(nn.Linear(d, 4 * d), nn.ReLU(), nn.Linear(4 * d, d))
        self.truth = truth
        self.hot = hot

    def split(self, n: int) -> list[int]:
        """Tokens each rank sends each expert: evenly, or (`hot`) that share of them to rank
        0's expert and the rest evenly to the others (a hot expert)."""
        w = self.world
        if self.hot is None or w < 2:
            return [n // w] * w
        first = int(n * self.hot)
        return [first] + [(n - first) // (w - 1)] * (w - 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rank, world = dist.get_rank(), self.world
        scores = self.router(x)
        counts = torch.bincount(scores.argmax(1), minlength=world)
        gathered = [torch.empty_like(counts) for _ in range(world)]
        dist.all_gather(gathered, counts)
        scale = torch.ones(1) * (rank + 1)
        dist.broadcast(scale, src=0)
        sizes = self.split(x.shape[0])     # every rank routes alike: it receives sizes[rank]
        send = list(x.detach().split(sizes))
        if self.hot is None:
            recv = [torch.empty(sizes[rank], x.shape[1]) for _ in range(world)]
            dist.all_to_all(recv, send)
            got = torch.cat(recv)
        else:     # gloo's all_to_all of lists takes tensors of one size: uneven splits here
            got = torch.empty(world * sizes[rank], x.shape[1])
            dist.all_to_all_single(got, x.detach(), [sizes[rank]] * world, sizes)
        out = self.expert(got) * scale
        back = torch.empty(sum(sizes), x.shape[1])
        work = dist.all_to_all_single(back, out.detach().contiguous(), sizes,
                                      [sizes[rank]] * world, async_op=True)
        extra = self.expert(send[0]).sum()         # compute while the exchange runs
        t0 = time.time_ns()
        running = not work.is_completed()
        work.wait()
        self.truth.waits.append({"it": self.truth.iteration, "kind": "all_to_all",
                                 "start": t0, "end": time.time_ns(), "running": running})
        return (out.sum() + extra + (back * 0).sum() + scores.sum() * 0) / x.shape[0]


class SyncSGD(torch.optim.SGD):
    """SGD whose step first all-reduces the gradients (async, then waited) and passes a
    token from rank 0 to rank 1."""

    def __init__(self, params: list[nn.Parameter], truth: Truth) -> None:
        super().__init__(params, lr=0.01)
        self.truth = truth

    def step(self, closure: object = None) -> None:  # type: ignore[override]
        grads = [p.grad for g in self.param_groups for p in g["params"]
                 if p.grad is not None]
        flat = torch.cat([g.flatten() for g in grads])
        rank = dist.get_rank()
        if rank == 1:
            time.sleep(0.05)     # rank 0 stands still in its wait() until rank 1 joins
        work = dist.all_reduce(flat, async_op=True)
        t0 = time.time_ns()
        running = not work.is_completed()
        work.wait()
        self.truth.waits.append({"it": self.truth.iteration, "kind": "all_reduce",
                                 "start": t0, "end": time.time_ns(), "running": running})
        token = torch.full((64,), float(rank))
        if rank == 0:
            dist.send(token, 1)
        else:
            dist.recv(token, 0)
        super().step()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--iterations", type=int, default=10)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--hot", type=float, default=None,
                   help="share of each rank's tokens routed to rank 0's expert")
    a = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(rank)
    truth = Truth()
    model = MoE(a.d, truth, a.hot)
    opt = SyncSGD(list(model.expert.parameters()), truth)
    x = torch.randn(a.tokens, a.d)
    for i in range(a.iterations):
        truth.begin(i)
        loss = truth.timed("forward", model, x)
        truth.timed("backward", loss.backward)
        truth.timed("update", opt.step)
        opt.zero_grad()
        truth.end()
    truth.dump(f"{a.out}.rank{rank}.json")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
