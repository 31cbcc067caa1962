"""Pipeline parallelism as torch.distributed.pipelining's docs write it: the model split by
hand into one stage per rank (`PipelineStage`), a schedule (`ScheduleGPipe` or
`Schedule1F1B`) over microbatches, the optimizer stepped after each `schedule.step`:

    torchrun --nproc_per_node 2 pp_train.py OUT [--schedule gpipe|1f1b] [--microbatches M]
                                                [--iterations N] [--blocks L] [--width D]

Each stage times its own work per microbatch: its forward (in the stage module's own
forward), its loss (the last stage's, in the loss function the schedule calls) and its
backward (from the gradient's arrival at the stage's output to its first
layer's last gradient, marked with autograd hooks of the job's own); each schedule.step and
optimizer step with perf_counter; its passes as the schedule runs them (`passes_s`: the
stage's chunks, the stage's own work around its module and autograd included). It counts
its collectives at the ProcessGroup (collective_truth) and writes OUT.rank<R>.json:
{"iterations" (start/end, step_s, update, passes_s, loss_s),
"microbatches": [{"it", "mb", "forward", "loss", "backward"}], "calls", "stage"}.
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
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from collective_truth import Truth  # noqa: E402

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


class Mark(torch.autograd.Function):
    """Identity whose backward notes when the gradient reached it."""

    @staticmethod
    def forward(ctx, x, note):
        ctx.note = note
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        ctx.note()
        return g, None


class Stage(nn.Module):
    def __init__(self, d: int, blocks: int, head: bool, clock: Clock) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[m for _ in range(blocks)
                                      for m in (nn.Linear(d, d), nn.ReLU())])
        self.head = nn.Linear(d, 10) if head else None
        self.clock = clock

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        out = self.layers(x)
        if self.head is not None:
            out = self.head(out)
        out = Mark.apply(out, self.clock.backward_began)
        self.clock.forward(time.perf_counter() - t0)
        return out


class Clock:
    """Per microbatch: forward seconds, backward from the gradient's arrival at the stage's
    output to the last gradient of its first layer (accumulated last)."""

    def __init__(self) -> None:
        self.it = -1
        self.mb: list[dict] = []
        self.fwd = 0
        self.bwd = 0
        self.t_bwd = 0.0
        self.pending = 0

    def forward(self, s: float) -> None:
        self.mb.append({"it": self.it, "mb": self.fwd, "forward": s, "backward": 0.0,
                        "loss": 0.0})
        self.fwd += 1

    def loss(self, s: float) -> None:
        """The last stage's loss of the microbatch it just computed."""
        self.mb[-1]["loss"] += s

    def backward_began(self) -> None:
        self.t_bwd = time.perf_counter()
        self.pending = 2          # the first layer's weight and bias

    def grad_done(self, _p) -> None:
        if self.pending:
            self.pending -= 1
            if not self.pending:
                rows = [m for m in self.mb if m["it"] == self.it]
                rows[self.bwd]["backward"] = time.perf_counter() - self.t_bwd
                self.bwd += 1

    def begin(self, it: int) -> None:
        self.it, self.fwd, self.bwd = it, 0, 0


def time_chunks(stage: PipelineStage) -> list[float]:
    """The stage's microbatch passes as its schedule runs them (forward_one_chunk,
    backward_one_chunk, backward_weight_one_chunk: the module's forward or autograd and the
    stage's own work around it), timed by the job: [seconds in this step so far]."""
    spent = [0.0]

    def timed(fn):
        def run(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[0] += time.perf_counter() - t0
        return run

    for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
        fn = getattr(stage, name, None)
        if fn is not None:
            setattr(stage, name, timed(fn))
    return spent


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--schedule", choices=tuple(SCHEDULES), default="gpipe")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--iterations", type=int, default=12)
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--batch", type=int, default=256)
    a = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)
    clock = Clock()
    mod = Stage(a.width, a.blocks, rank == world - 1, clock)
    first = mod.layers[0]
    for prm in (first.weight, first.bias):
        prm.register_post_accumulate_grad_hook(clock.grad_done)
    stage = PipelineStage(mod, rank, world, torch.device("cpu"))
    ce = nn.CrossEntropyLoss()

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        loss = ce(out, target)
        clock.loss(time.perf_counter() - t0)
        return loss

    passes = time_chunks(stage)
    sched = SCHEDULES[a.schedule](stage, a.microbatches, loss_fn=loss_fn)
    opt = torch.optim.SGD(mod.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(a.batch, a.width, generator=g)
    y = torch.randint(0, 10, (a.batch,), generator=g)
    truth = Truth()
    for i in range(a.iterations):
        truth.begin(i)
        clock.begin(i)
        passes[0] = 0.0
        t0 = time.perf_counter()
        if rank == 0:
            sched.step(x)
        elif rank == world - 1:
            sched.step(target=y, losses=[])
        else:
            sched.step()
        t1 = time.perf_counter()
        opt.step()
        t2 = time.perf_counter()
        opt.zero_grad()
        truth.end()
        truth.iterations[-1].update({"step_s": t1 - t0, "update": t2 - t1,
                                     "passes_s": passes[0], "loss_s": sum(
                                         m["loss"] for m in clock.mb if m["it"] == i)})
    with open(f"{a.out}.rank{rank}.json", "w") as f:
        json.dump({"calls": truth.calls, "iterations": truth.iterations,
                   "microbatches": clock.mb,
                   "stage": {"index": rank, "stages": world, "schedule": a.schedule,
                             "microbatches": a.microbatches}}, f)
    sched = stage = mod = opt = None
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
