"""A job's own clock of the collectives it issues through c10d's functional collectives
(DTensor, tensor parallelism), read from PyTorch's profiler (its CPU op events, recorded by
the dispatcher whatever Python layer issued them): each `_c10d_functional` op counted, and
the time in them summed (the all-reduce op returns at once, the collective running on the
backend's thread; `wait_tensor` is where the job stands still for it), by the job's
iteration and phase, which the job marks with record_function ranges. Imported by the
parallelism jobs of this folder."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch.autograd.profiler import record_function
from torch.profiler import ProfilerActivity, profile

KINDS = {"all_reduce": "all_reduce", "all_reduce_": "all_reduce",
         "all_gather_into_tensor": "all_gather", "all_gather_into_tensor_out": "all_gather",
         "reduce_scatter_tensor": "reduce_scatter", "all_to_all_single": "all_to_all",
         "broadcast": "broadcast", "broadcast_": "broadcast"}
_PREFIX = "_c10d_functional::"


class CommClock:
    def __init__(self) -> None:
        self.prof = profile(activities=[ProfilerActivity.CPU])

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

    def dump(self) -> dict[str, Any]:
        """{"functional": one {it, phase, kind, bytes?} per collective issued, "stood":
        [{it, phase, s}] the seconds in the functional ops per iteration and phase}."""
        calls: list[dict[str, Any]] = []
        stood: dict[tuple[int, str], float] = {}
        for e in self.prof.events():
            if not e.name.startswith(_PREFIX):
                continue
            it, phase, p = -1, "none", e.cpu_parent
            while p is not None:
                if p.name.startswith("phase:") and phase == "none":
                    phase = p.name[6:]
                elif p.name.startswith("it:"):
                    it = int(p.name[3:])
                    break
                p = p.cpu_parent
            if e.cpu_parent is not None and e.cpu_parent.name.startswith(_PREFIX):
                continue    # inside another functional op: counted there
            key = (it, phase)
            stood[key] = stood.get(key, 0.0) + e.time_range.elapsed_us() / 1e6
            kind = KINDS.get(e.name[len(_PREFIX):])
            if kind is not None:
                calls.append({"it": it, "phase": phase, "kind": kind})
        return {"functional": calls,
                "stood": [{"it": i, "phase": p, "s": s} for (i, p), s in stood.items()]}
