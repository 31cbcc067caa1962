"""The trace clock against the system's wall clock read in the same instants: every span of
a process is placed on it, and a job's own time.time_ns() readings are compared with it."""

from __future__ import annotations

import threading
import time

from gputrace.recorder.clock import Clock


def _spin(stop: threading.Event) -> None:
    while not stop.is_set():
        pass


def test_trace_clock_is_the_wall_clock_within_its_anchoring_error():
    """Read beside busy threads (a preempted anchor read would shift the whole process):
    each trace-clock reading lies between the wall-clock readings around it, give or take
    the anchor's own bracket."""
    stop = threading.Event()
    hogs = [threading.Thread(target=_spin, args=(stop,), daemon=True) for _ in range(2)]
    for h in hogs:
        h.start()
    try:
        for _ in range(20):
            c = Clock()
            assert c.error_ns < 1_000_000
            for _ in range(50):
                before = time.time_ns()
                t = c.now_ns()
                after = time.time_ns()
                assert before - c.error_ns <= t <= after + c.error_ns, (before, t, after)
    finally:
        stop.set()
        for h in hogs:
            h.join()
