"""A small CPU training loop with activation checkpointing that times itself with
perf_counter: the ground truth of the recompute tests.

    python checkpointed.py OUT.json [--mode nonreentrant|reentrant|wrapper|whole|none]
                           [--blocks N] [--steps N] [--dim D] [--batch B]

N residual MLP blocks (Linear, GELU, Linear, LayerNorm) in a ModuleList, then a head. Each
block runs under torch.utils.checkpoint (`nonreentrant`: use_reentrant=False, torch's
recommended form; `reentrant`: use_reentrant=True) or wrapped by
`checkpoint_wrapper` (`wrapper`: as FSDP2 and torchtitan apply it), or plainly (`none`);
`whole`: the loop checkpoints the whole model (non-reentrant).

Per optimizer step it writes (seconds; time.time_ns for `start`/`end`, the iterations tiling
the loop): `forward` (the model and the loss), `backward` (loss.backward(), the recompute
in it), `update` (optimizer.step), `other` (zero_grad and a logging `.item()`), and
`recompute`: the time the blocks' own forward ran while the loop stood in loss.backward().
Each block times its own forward body with perf_counter (in a `finally`: a non-reentrant
recompute that stops early raises out of it), and the loop knows when it is inside its
backward call: the recompute is the job's own, not told by anything gputrace reads.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

IN_BACKWARD = [False]
RECOMPUTE = [0.0]


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        try:
            return self.norm(x + self.down(torch.nn.functional.gelu(self.up(x))))
        finally:
            if IN_BACKWARD[0]:
                RECOMPUTE[0] += time.perf_counter() - t0


class Net(nn.Module):
    def __init__(self, d: int, n: int, mode: str) -> None:
        super().__init__()
        self.mode = mode
        blocks: list[nn.Module] = [Block(d) for _ in range(n)]
        if mode == "wrapper":
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
                checkpoint_wrapper,
            )

            blocks = [checkpoint_wrapper(b) for b in blocks]
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(d, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            if self.mode in ("nonreentrant", "reentrant"):
                x = checkpoint(b, x, use_reentrant=self.mode == "reentrant")
            else:
                x = b(x)
        return self.head(x)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--mode", default="nonreentrant",
                   choices=("nonreentrant", "reentrant", "wrapper", "whole", "none"))
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--steps", type=int, default=14)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--batch", type=int, default=256)
    a = p.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = Net(a.dim, a.blocks, a.mode)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = nn.CrossEntropyLoss()
    x = torch.randn(a.batch, a.dim, requires_grad=a.mode == "reentrant")
    y = torch.randint(0, 10, (a.batch,))
    now = time.perf_counter
    steps: list[dict[str, float]] = []
    t_prev = time.time_ns()
    for _ in range(a.steps):
        t0 = now()
        out = checkpoint(model, x, use_reentrant=False) if a.mode == "whole" else model(x)
        loss = loss_fn(out, y)
        t1 = now()
        RECOMPUTE[0] = 0.0
        IN_BACKWARD[0] = True
        loss.backward()
        IN_BACKWARD[0] = False
        t2 = now()
        opt.step()
        t3 = now()
        opt.zero_grad()
        float(loss.detach())
        t4 = now()
        t_end = time.time_ns()
        steps.append({"forward": t1 - t0, "backward": t2 - t1, "update": t3 - t2,
                      "other": t4 - t3, "recompute": RECOMPUTE[0],
                      "start": t_prev, "end": t_end})
        t_prev = t_end
    with open(a.out, "w") as f:
        json.dump(steps, f)


if __name__ == "__main__":
    main()
