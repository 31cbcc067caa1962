"""Pipeline parallelism as torch.distributed.pipelining's docs write it: the model split by
hand into stages (`PipelineStage`), one per rank or several (`--stages-per-rank`: rank r
holds stages r, r + p, ... or, for the V schedules, r and 2p - 1 - r), a schedule over
microbatches, the optimizer stepped after each `schedule.step` (`--then M2,...`: as many
iterations again at each of these microbatch counts, one recording at several counts); with `--dp D` the ranks
form D pipelines (pipeline x data parallel: rank = replica * p + pipeline rank), each
replica's gradients all-reduced over its data-parallel group after the step:

    torchrun --nproc_per_node 2 pp_train.py OUT [--schedule gpipe|1f1b|interleaved|
        loopedbfs|izb|zbv|dualpipev] [--stages-per-rank V] [--microbatches M] [--dp D]
        [--iterations N] [--blocks L] [--width D] [--batch B] [--then M2,M3]

Each stage times its own work per microbatch: its forward (in the stage module's own
forward), its loss (the last stage's, in the loss function the schedule calls) and, with one
stage per rank, its backward (from the gradient's arrival at the stage's output to its first
layer's last gradient, marked with autograd hooks of the job's own); each schedule.step and
optimizer step with perf_counter; its passes as the schedule runs them (`passes_s`: the
stages' chunks, the stage's own work around its module and autograd included; `chunks`:
per stage and kind, forward / backward / backward_weight, the seconds of each chunk and,
`autograd_s`, of torch's stage_backward inside it where the chunk made one, and
`autograd_call_s`, of the torch.autograd.backward call inside that); its
waits for its neighbours (`waits_s`: the schedule's waits on its sends and receives). It
counts its collectives at the ProcessGroup (collective_truth) and writes OUT.rank<R>.json:
{"iterations" (start/end, step_s, update, passes_s, loss_s, waits_s, grad_sync_s),
"microbatches": [{"it", "mb", "forward", "loss", "backward"}] (one stage per rank),
"chunks": [{"it", "stage", "kind", "mb", "s", "autograd_s", "autograd_call_s", "cpu_s",
"autograd_cpu_s"}],
"forwards": [{"it", "stage", "s", "cpu_s"}] (`cpu_s`: the thread's CPU seconds in it
(time.thread_time: the wall time less the wait for a CPU behind other processes),
"calls", "stage": {index, indices, stages, ranks, schedule, class, microbatches,
samples_per_iteration, replica, replicas}}.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as S
from torch.distributed.pipelining import stage as ST

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from collective_truth import Truth  # noqa: E402

SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B",
             "interleaved": "ScheduleInterleaved1F1B", "loopedbfs": "ScheduleLoopedBFS",
             "izb": "ScheduleInterleavedZeroBubble", "zbv": "ScheduleZBVZeroBubble",
             "dualpipev": "ScheduleDualPipeV"}
SINGLE = ("gpipe", "1f1b")
V_SHAPED = ("zbv", "dualpipev")


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
    def __init__(self, d: int, blocks: int, head: bool, clock: Clock, index: int) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[m for _ in range(blocks)
                                      for m in (nn.Linear(d, d), nn.ReLU())])
        self.head = nn.Linear(d, 10) if head else None
        self.clock = clock
        self.index = index

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t0, c0 = time.perf_counter(), time.thread_time()
        out = self.layers(x)
        if self.head is not None:
            out = self.head(out)
        if self.clock.marks:
            out = Mark.apply(out, self.clock.backward_began)
        self.clock.forward(time.perf_counter() - t0, self.index, time.thread_time() - c0)
        return out


class Clock:
    """Per microbatch: forward seconds, backward from the gradient's arrival at the stage's
    output to the last gradient of its first layer (accumulated last; one stage per rank)."""

    def __init__(self, marks: bool = True) -> None:
        self.marks = marks
        self.it = -1
        self.mb: list[dict] = []
        self.forwards: list[dict] = []
        self.fwd = 0
        self.bwd = 0
        self.t_bwd = 0.0
        self.pending = 0

    def forward(self, s: float, stage: int = -1, cpu_s: float | None = None) -> None:
        self.forwards.append({"it": self.it, "stage": stage, "s": s, "cpu_s": cpu_s})
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


def time_chunks(stage: PipelineStage, clock: Clock, chunks: list[dict]) -> list[float]:
    """The stage's microbatch passes as its schedule runs them (forward_one_chunk,
    backward_one_chunk, backward_weight_one_chunk: the module's forward or autograd and the
    stage's own work around it), timed by the job: [seconds in this step so far], each one
    also noted in `chunks`."""
    spent = [0.0]

    def timed(fn, kind):
        def run(chunk_id, *a, **k):
            AUTOGRAD[0] = AUTOGRAD[1] = AUTOGRAD[2] = None
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return fn(chunk_id, *a, **k)
            finally:
                s = time.perf_counter() - t0
                spent[0] += s
                chunks.append({"it": clock.it, "stage": stage.stage_index, "kind": kind,
                               "mb": int(chunk_id), "s": s, "autograd_s": AUTOGRAD[0],
                               "autograd_call_s": AUTOGRAD[2],
                               "cpu_s": time.thread_time() - c0,
                               "autograd_cpu_s": AUTOGRAD[1]})
        return run

    for name, kind in (("forward_one_chunk", "forward"), ("backward_one_chunk", "backward"),
                       ("backward_weight_one_chunk", "backward_weight")):
        fn = getattr(stage, name, None)
        if fn is not None:
            setattr(stage, name, timed(fn, kind))
    return spent


# the current chunk's stage_backward, if it ran one: its seconds, its CPU seconds, and the
# seconds of the torch.autograd.backward call inside it
AUTOGRAD: list[float | None] = [None, None, None]


def time_autograd() -> None:
    """The autograd inside a backward chunk (torch's stage_backward: the stage's
    torch.autograd.backward and its own work around it), timed by the job into the chunk's
    `autograd_s`, and the torch.autograd.backward call alone into `autograd_call_s`; None
    where the chunk ran none (the zero-bubble schedules' split backward runs
    autograd.grad)."""
    orig = ST.stage_backward
    inside = [False]

    def stage_backward(*a, **k):
        t0, c0 = time.perf_counter(), time.thread_time()
        inside[0] = True
        try:
            return orig(*a, **k)
        finally:
            inside[0] = False
            AUTOGRAD[0] = (AUTOGRAD[0] or 0.0) + time.perf_counter() - t0
            AUTOGRAD[1] = (AUTOGRAD[1] or 0.0) + time.thread_time() - c0

    call = torch.autograd.backward

    @functools.wraps(call)
    def backward(*a, **k):
        if not inside[0]:
            return call(*a, **k)
        t0 = time.perf_counter()
        try:
            return call(*a, **k)
        finally:
            AUTOGRAD[2] = (AUTOGRAD[2] or 0.0) + time.perf_counter() - t0

    ST.stage_backward = stage_backward
    torch.autograd.backward = backward


def time_waits() -> list[float]:
    """The schedule's waits on its sends and receives (torch's _wait_batch_p2p), timed by
    the job: [seconds in this step so far]."""
    spent = [0.0]
    orig = S._wait_batch_p2p

    def wait(work):
        t0 = time.perf_counter()
        try:
            return orig(work)
        finally:
            spent[0] += time.perf_counter() - t0

    S._wait_batch_p2p = wait
    return spent


def held(rank: int, p: int, v: int, schedule: str) -> list[int]:
    """The stages pipeline rank `rank` holds: looped (r, r + p, ...) or V-shaped."""
    if schedule in V_SHAPED:
        return [rank, 2 * p - 1 - rank]
    return [rank + k * p for k in range(v)]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--schedule", choices=tuple(SCHEDULES), default="gpipe")
    p.add_argument("--stages-per-rank", type=int, default=0,
                   help="default: 1 (2 for the V schedules and the interleaved ones)")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--iterations", type=int, default=12)
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--split", default="",
                   help="blocks of each stage, comma-separated (an uneven cut of the model "
                        "for a rebalancing what-if), in place of --blocks")
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--then", default="",
                   help="M2,M3,...: after the iterations, as many more at each of these "
                        "microbatch counts in turn (a schedule over new stages of the same "
                        "modules each)")
    a = p.parse_args()
    v = a.stages_per_rank or (1 if a.schedule in SINGLE else 2)
    if a.schedule in SINGLE and v != 1 or a.schedule in V_SHAPED and v != 2:
        p.error(f"--schedule {a.schedule} holds {1 if a.schedule in SINGLE else 2} stages "
                "per rank")
    cls = getattr(S, SCHEDULES[a.schedule], None)
    if cls is None:
        p.error(f"this torch has no {SCHEDULES[a.schedule]}")
    split = [int(x) for x in a.split.split(",") if x]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    pp = world // a.dp
    replica, prank = divmod(rank, pp)
    pp_group = dp_group = None          # one pipeline: the default group
    if a.dp > 1:
        pp_groups = [dist.new_group(list(range(r * pp, (r + 1) * pp))) for r in range(a.dp)]
        dp_groups = [dist.new_group(list(range(k, world, pp))) for k in range(pp)]
        pp_group, dp_group = pp_groups[replica], dp_groups[prank]
    n = pp * v
    if split and len(split) != n:
        p.error(f"--split gives {len(split)} stages; the job has {n}")
    torch.manual_seed(prank)
    clock = Clock(marks=v == 1)
    indices = held(prank, pp, v, a.schedule)
    chunks: list[dict] = []
    mods, stages = [], []
    passes = None
    for idx in indices:
        mod = Stage(a.width, split[idx] if split else a.blocks, idx == n - 1, clock, idx)
        if v == 1:
            first = mod.layers[0]
            for prm in (first.weight, first.bias):
                prm.register_post_accumulate_grad_hook(clock.grad_done)
        stage = PipelineStage(mod, idx, n, torch.device("cpu"), group=pp_group)
        spent = time_chunks(stage, clock, chunks)
        passes = passes or []
        passes.append(spent)
        mods.append(mod)
        stages.append(stage)
    waits = time_waits()
    time_autograd()
    ce = nn.CrossEntropyLoss()

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        loss = ce(out, target)
        clock.loss(time.perf_counter() - t0)
        return loss

    def schedule(sts: list, m: int):  # noqa: ANN202 - a torch schedule
        return cls(sts[0], m, loss_fn=loss_fn) if v == 1 and a.schedule in SINGLE else \
            cls(sts, m, loss_fn=loss_fn)

    sched = schedule(stages, a.microbatches)
    counts = [a.microbatches] * a.iterations
    blocks = [(0, sched, passes)]
    for m2 in (int(x) for x in a.then.split(",") if x):
        more, spent2 = [], []
        for idx, mod in zip(indices, mods, strict=True):
            st = PipelineStage(mod, idx, n, torch.device("cpu"), group=pp_group)
            spent2.append(time_chunks(st, clock, chunks))
            more.append(st)
        blocks.append((len(counts), schedule(more, m2), spent2))
        counts += [m2] * a.iterations
    params = [q for m in mods for q in m.parameters()]
    opt = torch.optim.SGD(params, lr=0.01)
    g = torch.Generator().manual_seed(replica)
    x = torch.randn(a.batch, a.width, generator=g)
    y = torch.randint(0, 10, (a.batch,), generator=g)
    truth = Truth()
    for i in range(len(counts)):
        if blocks and blocks[0][0] == i:
            _, sched, passes = blocks.pop(0)
        truth.begin(i)
        clock.begin(i)
        for s in passes:
            s[0] = 0.0
        waits[0] = 0.0
        t0 = time.perf_counter()
        kw = {}
        if n - 1 in indices:
            kw = {"target": y, "losses": []}
        if 0 in indices:
            sched.step(x, **kw)
        else:
            sched.step(**kw)
        t1 = time.perf_counter()
        if a.dp > 1:           # the replicas' gradients, one all-reduce of them all
            flat = torch.cat([q.grad.reshape(-1) for q in params])
            dist.all_reduce(flat, group=dp_group)
            flat /= a.dp
            at = 0
            for q in params:
                q.grad.copy_(flat[at:at + q.numel()].view_as(q))
                at += q.numel()
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        opt.zero_grad()
        truth.end()
        truth.iterations[-1].update({
            "step_s": t1 - t0, "grad_sync_s": t2 - t1, "update": t3 - t2,
            "passes_s": sum(s[0] for s in passes), "waits_s": waits[0],
            "loss_s": sum(m["loss"] for m in clock.mb if m["it"] == i),
            "microbatches": counts[i]})
    with open(f"{a.out}.rank{rank}.json", "w") as f:
        json.dump({"calls": truth.calls, "iterations": truth.iterations,
                   "microbatches": clock.mb if v == 1 else [], "chunks": chunks,
                   "forwards": clock.forwards,
                   "stage": {"index": indices[0], "indices": indices, "stages": n,
                             "ranks": pp, "schedule": a.schedule,
                             "class": SCHEDULES[a.schedule],
                             "microbatches": a.microbatches,
                             "samples_per_iteration": a.batch, "replica": replica,
                             "replicas": a.dp}}, f)
    sched = stages = mods = opt = None
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
