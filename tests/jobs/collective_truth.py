"""A job's own count of the collectives it issues: the ProcessGroup's methods (the C++
binding every torch.distributed call ends in) wrapped at the class, each call noted with
the job's current iteration and phase, its kind and this rank's input bytes (a recv's
received bytes as `bytes_out`; an all-to-all's bytes to each peer as `peers`). Imported by
the jobs in this folder; written as JSON by `dump`."""

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


def _peers(name: str, pg: Any, a: tuple[Any, ...]) -> list[int]:
    """An all-to-all's bytes to each rank of the group: its input list's tensors, or its
    input tensor's rows as its input split sizes say (even splits without them)."""
    if name == "alltoall":
        return [_nb(t) for t in a[1]]
    x = a[1]
    rows = x.shape[0] if x.dim() else 1
    per_row = _nb(x) // max(rows, 1)
    splits = list(a[3]) if len(a) > 3 and a[3] else [rows // pg.size()] * pg.size()
    return [int(n) * per_row for n in splits]


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
        self.probe: dict[str, Any] = {}     # a job's own timing of its collectives
        for name, kind in KIND.items():
            orig = getattr(ProcessGroup, name, None)
            if orig is None:
                continue
            setattr(ProcessGroup, name, self._counting(name, kind, orig))

    def _counting(self, name: str, kind: str, orig: Any) -> Any:
        pos = INPUT[name]

        def counted(pg: Any, *a: Any, **k: Any) -> Any:
            call = {"it": self.iteration, "phase": self.phase, "kind": kind,
                    "bytes": 0 if pos is None or len(a) <= pos else _nb(a[pos]),
                    "t": time.time_ns()}
            if name == "recv":
                call["bytes_out"] = _nb(a[0]) if a else 0
            elif kind == "all_to_all":
                call["peers"] = _peers(name, pg, a)
            self.calls.append(call)
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
                       "waits": self.waits, "functional": self.functional,
                       "probe": self.probe}, f)
