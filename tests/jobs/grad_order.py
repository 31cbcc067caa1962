"""Four blocks in an nn.Sequential, the third with two experts: both run in the first
iterations, then one at a time (a routed block whose last gradient changes). The job times
its own gradients: a post-accumulate-grad hook of its own on every parameter writes, per
iteration and block, when the block's first and last gradients came (time.time_ns), to
argv[1]; at the end, how many hooks each block's parameters hold, and which gradient hooks
at all the parameters of a second model hold (one the job put none on)."""

from __future__ import annotations

import json
import sys
import time

import torch
from torch import nn

W = 384


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(W)
        self.fc1 = nn.Linear(W, 2 * W)
        self.fc2 = nn.Linear(2 * W, W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(self.ln(x))))


class Routed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList([Block(), Block()])
        self.route: list[int] = [0, 1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(self.experts[i](x) for i in self.route) / len(self.route)


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = nn.Sequential(Block(), Block(), Routed(), Block())
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    step = [0]
    first: dict[tuple[int, int], int] = {}
    last: dict[tuple[int, int], int] = {}
    for b, block in enumerate(model):
        for p in block.parameters():
            def mine(_p: torch.Tensor, b: int = b) -> None:
                t = last[(step[0], b)] = time.time_ns()
                first.setdefault((step[0], b), t)
            p.register_post_accumulate_grad_hook(mine)
    x = torch.randn(96, W)
    for i in range(int(sys.argv[2])):
        step[0] = i
        model[2].route = [0, 1] if i < 3 else [i % 2]
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
    hooks = [[len(p._post_accumulate_grad_hooks or {}) for p in block.parameters()]
             for block in model]
    # a model without hooks of the job's: which gradient hooks its parameters hold at all
    # (a tensor's hooks dict is None until a hook was registered on it; torch keeps a
    # post-accumulate-grad hook's C++ side for the tensor's life once one was)
    bare = nn.Sequential(Block(), Block())
    opt = torch.optim.SGD(bare.parameters(), lr=1e-3)
    for _ in range(3):
        opt.zero_grad()
        bare(x).pow(2).mean().backward()
        opt.step()
    held = [[[p._post_accumulate_grad_hooks is not None, p._backward_hooks is not None]
             for p in block.parameters()] for block in bare]
    with open(sys.argv[1], "w") as f:
        json.dump({"first": [[s, b, t] for (s, b), t in sorted(first.items())],
                   "last": [[s, b, t] for (s, b), t in sorted(last.items())],
                   "hooks": hooks, "bare": held}, f)


if __name__ == "__main__":
    main()
