"""One trace clock: CLOCK_REALTIME ns, read cheaply through an anchored perf counter."""

from __future__ import annotations

import os
import time
from typing import Any

_perf = time.perf_counter_ns


def _test_shift() -> int:
    """For tests only: GPUTRACE_TEST_CLOCK_SHIFT_NS moves this process's trace clock, as a
    node whose clock is off by that much would (multi-node clock alignment is tested with
    it on one machine). Never set it on a real run."""
    try:
        return int(os.environ.get("GPUTRACE_TEST_CLOCK_SHIFT_NS", "0"))
    except ValueError:
        return 0


SHIFT_NS = _test_shift()
ANCHOR_TRIES = 16


class Clock:
    """Realtime nanoseconds taken as anchor + perf_counter delta (monotonic between anchors)."""

    __slots__ = ("_offset", "error_ns", "start")

    def __init__(self) -> None:
        self._offset = 0
        self.start: dict[str, int] = {}
        self.reanchor()

    def reanchor(self) -> None:
        # Bracket the realtime read with two perf reads to halve the anchoring error, and
        # keep the tightest of several brackets: a read preempted on a busy machine (by
        # hundreds of microseconds) would put every span of the process off by half of it.
        best = None
        for _ in range(ANCHOR_TRIES):
            p0 = _perf()
            rt = time.time_ns()
            p1 = _perf()
            if best is None or p1 - p0 < best[0]:
                best = (p1 - p0, rt - (p0 + p1) // 2)
        assert best is not None
        self._offset = best[1] + SHIFT_NS
        self.error_ns = best[0] // 2 + 1
        self.start = self.anchor()

    def now_ns(self) -> int:
        return self._offset + _perf()

    def from_perf(self, perf_ns: int) -> int:
        return self._offset + perf_ns

    @staticmethod
    def anchor() -> dict[str, int]:
        return {"monotonic_ns": time.monotonic_ns(), "realtime_ns": time.time_ns() + SHIFT_NS,
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
