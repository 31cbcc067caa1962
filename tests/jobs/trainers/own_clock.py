"""The trainer jobs' own clock: each job times its phases with perf_counter where the trainer
lets it (its hooks, callbacks, overridden methods) and writes them, per rank, as the ground
truth the trainer tests hold gputrace's analysis against.

OUT.rank<R>.json: {"steps": [{"start", "end" (time.time_ns: iterations tile the loop, the
next begins where this one ended), "forward", "backward", "update" (seconds), "samples" (the
samples the job fed its model in the iteration)}], and whatever the job adds (its DDP
buckets, its world size)}.
"""

from __future__ import annotations

import json
import time

import torch
from torch import nn

PHASES = ("forward", "backward", "update")


class OwnClock:
    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []
        self.t_prev = time.time_ns()
        self._new()
        self.open: dict[str, float] = {}
        self.extra: dict[str, object] = {}

    def _new(self) -> None:
        self.cur = dict.fromkeys(PHASES, 0.0)
        self.cur["samples"] = 0

    def start(self, phase: str) -> None:
        self.open[phase] = time.perf_counter()

    def stop(self, phase: str) -> None:
        t0 = self.open.pop(phase, None)
        if t0 is not None:
            self.cur[phase] += time.perf_counter() - t0

    def add(self, phase: str, seconds: float) -> None:
        self.cur[phase] += seconds

    def fed(self, samples: int) -> None:
        """The job fed its model a batch of `samples` in this iteration."""
        self.cur["samples"] += int(samples)

    def step_done(self) -> None:
        """An optimizer step's iteration ends here (the next begins)."""
        t = time.time_ns()
        self.cur["start"], self.cur["end"] = self.t_prev, t
        self.t_prev = t
        self.steps.append(self.cur)
        self._new()

    def write(self, prefix: str, rank: int) -> None:
        with open(f"{prefix}.rank{rank}.json", "w") as f:
            json.dump({"steps": self.steps, **self.extra}, f)


def blocks_model(width: int = 512, depth: int = 4, classes: int = 10) -> nn.Module:
    """An MLP of `depth` blocks (Linear + ReLU in a ModuleList), the shape gputrace's default
    granularity times block by block."""

    class Blocks(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.ReLU())
                                        for _ in range(depth))
            self.head = nn.Linear(width, classes)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for b in self.blocks:
                x = b(x)
            return self.head(x)

    return Blocks()


def ddp_buckets(ddp: nn.Module) -> list[int]:
    """The bytes of each bucket DDP reduces, as its own logging data says (after the
    rebuild that follows the first backward)."""
    d = ddp._get_ddp_logging_data()
    sizes = d.get("rebuilt_bucket_sizes") or d.get("bucket_sizes") or ""
    return [int(x) for x in str(sizes).split(",") if x.strip()]


def dataset(n: int, width: int = 512, classes: int = 10) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(torch.randn(n, width, generator=g),
                                          torch.randint(0, classes, (n,), generator=g))
