"""One trace clock: CLOCK_REALTIME ns, read cheaply through an anchored perf counter."""

from __future__ import annotations

import time
from typing import Any

_perf = time.perf_counter_ns


class Clock:
    """Realtime nanoseconds taken as anchor + perf_counter delta (monotonic between anchors)."""

    __slots__ = ("_offset", "start")

    def __init__(self) -> None:
        self._offset = 0
        self.start: dict[str, int] = {}
        self.reanchor()

    def reanchor(self) -> None:
        # Bracket the realtime read with two perf reads to halve the anchoring error.
        p0 = _perf()
        rt = time.time_ns()
        p1 = _perf()
        self._offset = rt - (p0 + p1) // 2
        self.start = self.anchor()

    def now_ns(self) -> int:
        return self._offset + _perf()

    def from_perf(self, perf_ns: int) -> int:
        return self._offset + perf_ns

    @staticmethod
    def anchor() -> dict[str, int]:
        return {"monotonic_ns": time.monotonic_ns(), "realtime_ns": time.time_ns(),
                "perf_ns": _perf()}


def anchors_report(start: dict[str, Any], end: dict[str, Any]) -> str | None:
    """Say whether the wall clock stepped between two anchors; None when it did not."""
    try:
        mono = end["monotonic_ns"] - start["monotonic_ns"]
        real = end["realtime_ns"] - start["realtime_ns"]
    except (KeyError, TypeError):
        return None
    step = real - mono
    if abs(step) > 50_000_000:
        return f"wall clock stepped by {step / 1e9:+.3f} s during the run"
    return None
