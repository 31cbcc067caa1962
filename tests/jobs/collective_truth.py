"""A job's own count of the collectives it issues: the ProcessGroup's methods (the C++
binding every torch.distributed call ends in) wrapped at the class, each call noted with
the job's current iteration and phase, its kind and this rank's input bytes. Imported by the
jobs in this folder; written as JSON by `dump`."""

from __future__ import annotations

import json
import time
from typing import Any

import torch
from torch.distributed import ProcessGroup

KIND = {"allreduce": "all_reduce", "allgather": "all_gather",
        "all_gather_single": "all_gather", "reduce_scatter": "reduce_scatter",
        "reduce_scatter_single": "reduce_scatter", "broadcast": "broadcast",
        "alltoall": "all_to_all", "all_to_all_single": "all_to_all", "barrier": "barrier",
        "send": "send_recv", "recv": "send_recv", "reduce": "reduce", "gather": "gather",
        "scatter": "scatter"}


def _nb(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nb(y) for y in x)
    return 0


# the argument holding this rank's input, per ProcessGroup method (None: no input)
INPUT = {"allreduce": 0, "allgather": 1, "all_gather_single": 1, "reduce_scatter": 1,
         "reduce_scatter_single": 1, "broadcast": 0, "alltoall": 1, "all_to_all_single": 1,
         "barrier": None, "send": 0, "recv": None, "reduce": 0, "gather": 1, "scatter": 1}


class Truth:
    def __init__(self) -> None:
        self.iteration = -1
        self.phase = "none"
        self.calls: list[dict[str, Any]] = []
        self.iterations: list[dict[str, Any]] = []
        self.waits: list[dict[str, Any]] = []
        self.functional: list[dict[str, Any]] = []
        for name, kind in KIND.items():
            orig = getattr(ProcessGroup, name, None)
            if orig is None:
                continue
            setattr(ProcessGroup, name, self._counting(name, kind, orig))

    def _counting(self, name: str, kind: str, orig: Any) -> Any:
        pos = INPUT[name]

        def counted(pg: Any, *a: Any, **k: Any) -> Any:
            self.calls.append({"it": self.iteration, "phase": self.phase, "kind": kind,
                               "bytes": 0 if pos is None or len(a) <= pos else _nb(a[pos]),
                               "t": time.time_ns()})
            return orig(pg, *a, **k)

        return counted

    def begin(self, i: int) -> None:
        self.iteration = i
        self.phase = "none"
        self.iterations.append({"it": i, "start": time.time_ns(), "forward": 0.0,
                                "backward": 0.0, "update": 0.0})

    def end(self) -> None:
        self.iterations[-1]["end"] = time.time_ns()
        self.phase = "none"
        self.iteration = -1

    def timed(self, phase: str, fn: Any, *a: Any) -> Any:
        """fn(*a) as the job's `phase`, its duration added to the iteration's."""
        self.phase = phase
        t0 = time.perf_counter()
        out = fn(*a)
        self.iterations[-1][phase] += time.perf_counter() - t0
        self.phase = "none"
        return out

    def dump(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump({"calls": self.calls, "iterations": self.iterations,
                       "waits": self.waits, "functional": self.functional}, f)
