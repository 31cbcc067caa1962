"""The process's life as recorded: a `process` span named `run`, from the process's start
as the kernel has it to the recording's end, written when the recorder closes (the whole
run's clock: analyzers.extras.goodput); and at once a `process` span named `start`, from the same
start to the recorder's, so that a run that never closes (killed, then `gputrace recover`)
still has its start. Installed once per recorder by the framework collector
that comes first (torch's, TensorFlow's)."""

from __future__ import annotations

import os
import time

from gputrace.recorder.core import Recorder

_done: list[Recorder] = []     # the recorders whose span is installed
# the modules whose import record's post-import hook saw end (record.inprocess): their
# collector installs as their import returns, so its moment is the import's end
IMPORTED_WHILE_RECORDING: set[str] = set()


def process_start_ns(now_ns: int) -> tuple[int, str] | None:
    """This process's start on the clock `now_ns` was read on (just before), and its source:
    /proc's ticks since boot against CLOCK_BOOTTIME (10 ms ticks), else psutil's
    create_time (whole-second boot time: up to a second off). None where neither tells."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        since = time.clock_gettime_ns(time.CLOCK_BOOTTIME) - ticks * 10**9 // os.sysconf(
            "SC_CLK_TCK")
        return now_ns - since, "proc"
    except (OSError, ValueError, IndexError, AttributeError):
        pass
    try:
        import psutil

        return now_ns - int((time.time() - psutil.Process().create_time()) * 1e9), "psutil"
    except Exception:  # noqa: BLE001 - no start known: no `run` span, no goodput
        return None


def install_run_span(rec: Recorder, until: str | None = None) -> None:
    """The process's `run` span at the recorder's close (once per recorder), and its
    `start` span now; `until`: what this moment is in the job's start-up (torch's collector:
    "torch imported", installed as torch's import returns)."""
    if any(r is rec for r in _done):
        return
    _done.append(rec)
    got = process_start_ns(rec.clock.now_ns())
    if got is None:
        return
    start, source = got
    pid = os.getpid()
    args = {"start_from": source} if until is None else {"start_from": source,
                                                          "until": until}
    rec.span("process", "start", start, max(start, rec.clock.now_ns()), step=-1, args=args)

    def run_span(t: int) -> None:
        if os.getpid() == pid:      # not a forked child's (a loader worker's)
            # to now: a close hook before this one (the pipeline probe) ran in the job's time
            rec.span("process", "run", start, max(t, rec.clock.now_ns()), step=-1,
                     args={"start_from": source})

    rec.close_hooks.append(run_span)
