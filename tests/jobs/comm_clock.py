"""A job's own clock of the collectives it issues through c10d's functional collectives
(DTensor, tensor parallelism), read from PyTorch's profiler (its CPU op events, recorded by
the dispatcher whatever Python layer issued them): each `_c10d_functional` op counted with
its input bytes (the profiler's input shapes and dtypes: `record_shapes`), and the time in
them summed (the all-reduce op returns at once, the collective running on the backend's
thread; `wait_tensor` is where the job stands still for it), by the job's iteration and
phase, which the job marks with record_function ranges. A job that marks its blocks
(`block` around each block's forward, `edge` on its input and output) gets each collective's
block too: in the forward the block range holding it, in the backward the block whose
output's gradient had arrived and whose input's gradient had not left when it was issued.
Imported by the parallelism jobs of this folder."""

from __future__ import annotations

import bisect
import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.autograd import DeviceType
from torch.autograd.profiler import record_function
from torch.autograd.profiler_util import _filter_name
from torch.profiler import ProfilerActivity, profile

KINDS = {"all_reduce": "all_reduce", "all_reduce_": "all_reduce",
         "all_gather_into_tensor": "all_gather", "all_gather_into_tensor_out": "all_gather",
         "reduce_scatter_tensor": "reduce_scatter", "all_to_all_single": "all_to_all",
         "broadcast": "broadcast", "broadcast_": "broadcast"}
_PREFIX = "_c10d_functional::"
# the profiler's dtype names (c10's C++ names) -> bytes per element
ITEMSIZE = {"float": 4, "double": 8, "c10::Half": 2, "c10::BFloat16": 2, "long int": 8,
            "int": 4, "short int": 2, "signed char": 1, "unsigned char": 1, "bool": 1,
            "c10::complex<float>": 8, "c10::complex<double>": 16}


def _nbytes(shapes: list[list[int]], dtypes: list[str]) -> int | None:
    """The op's first input's bytes (the tensor it sends), None when not recorded."""
    if not shapes or not dtypes or dtypes[0] not in ITEMSIZE:
        return None
    n = 1
    for x in shapes[0]:
        n *= int(x)
    return n * ITEMSIZE[dtypes[0]]


class _Edge(torch.autograd.Function):
    """Identity whose backward leaves a marker in the profiler when the gradient passes."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, label: str) -> torch.Tensor:
        ctx.label = label
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        with record_function(ctx.label):
            pass
        return g, None


class CommClock:
    def __init__(self) -> None:
        self.prof = profile(activities=[ProfilerActivity.CPU], record_shapes=True)

    def __enter__(self) -> CommClock:
        self.prof.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.prof.__exit__(*exc)

    @contextlib.contextmanager
    def iteration(self, i: int) -> Iterator[None]:
        with record_function(f"it:{i}"):
            yield

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        with record_function(f"phase:{name}"):
            yield

    @contextlib.contextmanager
    def block(self, k: int) -> Iterator[None]:
        """Block k's forward (1 from the input side)."""
        with record_function(f"block:{k}"):
            yield

    @staticmethod
    def edge(x: torch.Tensor, k: int, side: str) -> torch.Tensor:
        """x at block k's input (`side` "in") or output ("out"): in the backward, a marker
        when its gradient passes."""
        return _Edge.apply(x, f"bmark:{side}:{k}")

    def dump(self) -> dict[str, Any]:
        """{"functional": one {it, phase, kind, bytes, block} per collective issued (block -1:
        none known), "stood": [{it, phase, s}] the seconds in the functional ops per
        iteration and phase}. Read from the profiler's raw events, each op's enclosing ranges
        found as torch's own event tree finds them (an event inside another's interval on
        its thread): building that tree (`prof.events()`) took half the CPU of a job."""
        calls: list[dict[str, Any]] = []
        stood: dict[tuple[int, str], float] = {}
        events = [e for e in self.prof.profiler.kineto_results.events()
                  if e.device_type() == DeviceType.CPU and not e.is_async()
                  and not _filter_name(e.name())]
        parent = _parents(events)
        marks = sorted((e.start_ns(), e.name().split(":")[1], int(e.name().split(":")[2]))
                       for e in events if e.name().startswith("bmark:"))
        at = [m[0] for m in marks]
        for k, e in enumerate(events):
            name = e.name()
            if not name.startswith(_PREFIX):
                continue
            it, phase, block, p = -1, "none", -1, parent[k]
            while p >= 0:
                up = events[p].name()
                if up.startswith("block:") and block < 0:
                    block = int(up[6:])
                elif up.startswith("phase:") and phase == "none":
                    phase = up[6:]
                elif up.startswith("it:"):
                    it = int(up[3:])
                    break
                p = parent[p]
            if parent[k] >= 0 and events[parent[k]].name().startswith(_PREFIX):
                continue    # inside another functional op: counted there
            key = (it, phase)
            stood[key] = stood.get(key, 0.0) + e.duration_ns() / 1e9
            kind = KINDS.get(name[len(_PREFIX):])
            if kind is None:
                continue
            if phase == "backward" and block < 0:
                i = bisect.bisect_right(at, e.start_ns()) - 1
                if i >= 0 and marks[i][1] == "out":   # inside that block's backward
                    block = marks[i][2]
            calls.append({"it": it, "phase": phase, "kind": kind,
                          "bytes": _nbytes(e.shapes(), e.dtypes()), "block": block})
        return {"functional": calls,
                "stood": [{"it": i, "phase": p, "s": s} for (i, p), s in stood.items()]}


def _parents(events: list[Any]) -> list[int]:
    """Each event's parent (its index, -1 none): on its thread, the innermost event whose
    interval holds it, as torch's profiler builds its tree (profiler_util's
    _populate_cpu_children)."""
    parent = [-1] * len(events)
    order = sorted(range(len(events)), key=lambda k: (events[k].start_thread_id(),
                                                       events[k].start_ns(),
                                                       -events[k].end_ns()))
    stack: list[int] = []
    thread = None
    for k in order:
        e = events[k]
        if e.start_thread_id() != thread:
            thread, stack = e.start_thread_id(), []
        while stack:
            q = events[stack[-1]]
            if e.start_ns() >= q.end_ns() or e.end_ns() > q.end_ns():
                stack.pop()
            else:
                parent[k] = stack[-1]
                break
        stack.append(k)
    return parent
