"""The phase each memory peak happened in, from the memory read at the training loop's
phase boundaries (collectors.memory.PhaseMemory): rows `rss` / `cuda_allocated` (the memory
at a phase's start or end) and `rss_peak` / `cuda_allocated_peak` (the high-water mark,
written when it changed) whose `args` name the phase and the edge.

A high-water mark that changed between two marks rose in the phase open between them (the
innermost, where phases nest: Lightning runs forward and backward inside the optimizer's
step); between phases (the loss, zero_grad, before the loop) it rose `outside phases`. A
phase's peak is the highest memory seen at its boundaries, or the new high-water mark where
one rose inside it (then exact). The peak's phase is where the high-water mark first came
within PEAK_TOLERANCE of its highest: a process whose memory creeps up by a few pages after
its peak still names the phase that made it."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

OUTSIDE = "outside phases"
PEAK_TOLERANCE = 0.01
# the current memory at a boundary and its high-water mark, per measure
MEASURES = {"rss": ("rss", "rss_peak"), "cuda_allocated": ("cuda_allocated",
                                                           "cuda_allocated_peak")}
_CURRENT = {cur: m for m, (cur, _) in MEASURES.items()}
_PEAK = {pk: m for m, (_, pk) in MEASURES.items()}


@dataclass
class Attribution:
    """One process's memory by phase, per (measure, device)."""

    phases: dict[tuple[str, int], dict[str, float]] = field(default_factory=dict)
    # (time, high-water mark, phase) each time the mark rose
    rises: dict[tuple[str, int], list[tuple[int, float, str]]] = field(default_factory=dict)

    def peak_phase(self, key: tuple[str, int], peak: float | None) -> str | None:
        """The phase in which the high-water mark first came within PEAK_TOLERANCE of
        `peak` (the process's highest, marks or not); None without marks."""
        rises = self.rises.get(key)
        if not rises or peak is None:
            return None
        for _, v, where in rises:
            if v >= peak * (1 - PEAK_TOLERANCE):
                return where
        return OUTSIDE       # after the last mark (a checkpoint written at the end)


def tag(args: str | None) -> tuple[str, bool] | None:
    """(phase, is_end) of a boundary row's args; None for other rows."""
    if not args:
        return None
    try:
        d = json.loads(args)
        return str(d["phase"]), d.get("edge") == "end"
    except (ValueError, KeyError, TypeError):
        return None


def attribute(rows: Iterable[dict[str, Any]]) -> Attribution:
    """`rows` of one process (name, device, value, start_ns, args), any order."""
    marks = []
    for i, r in enumerate(rows):
        t = tag(r.get("args"))
        if t is not None and (r["name"] in _CURRENT or r["name"] in _PEAK):
            marks.append((r["start_ns"], i, r, t))
    marks.sort(key=lambda m: (m[0], m[1]))
    out = Attribution()
    open_: list[str] = []
    last: dict[tuple[str, int], float] = {}
    prev = None
    where = OUTSIDE
    for t, _, r, (phase, end) in marks:
        if (t, phase, end) != prev:   # a new boundary: where the memory was since the last
            where = phase if end and phase in open_ else (open_[-1] if open_ else OUTSIDE)
            if end and phase in open_:
                i = len(open_) - 1 - open_[::-1].index(phase)
                del open_[i:]
            elif not end:
                open_.append(phase)
            prev = (t, phase, end)
        name, dev = r["name"], int(r["device"])
        v = float(r["value"])
        if name in _CURRENT:
            key = (_CURRENT[name], dev)
            got = out.phases.setdefault(key, {})
            got[phase] = max(got.get(phase, 0.0), v)
        else:
            key = (_PEAK[name], dev)
            if v != last.get(key):
                out.rises.setdefault(key, []).append((t, v, where))
                got = out.phases.setdefault(key, {})
                got[where] = max(got.get(where, 0.0), v)
            last[key] = v
    return out
