"""The run around the iterations: the process's life as recorded (a `process` span named
`run`, from the process's start as the kernel has it to the recording's end, written when
the recorder closes) and the distributed initialization (`startup` spans named
`init_process_group`), both step -1."""

from __future__ import annotations

import functools
import os
import time
from typing import Any

from gputrace.collectors.torch import flight
from gputrace.collectors.torch.guard import _guarded
from gputrace.recorder import Recorder


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


def install(rec: Recorder, get_state: Any) -> None:
    """The process's `run` span at close; init_process_group timed."""
    got = process_start_ns(rec.clock.now_ns())
    if got is not None:
        start, source = got
        pid = os.getpid()

        def run_span(t: int) -> None:
            if os.getpid() == pid:      # not a forked child's (a loader worker's)
                rec.span("process", "run", start, t, step=-1, args={"start_from": source})

        rec.close_hooks.append(run_span)
    _patch_init(get_state)


def _patch_init(get_state: Any) -> None:
    try:
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d
    except Exception:  # noqa: BLE001 - a torch built without distributed
        return
    orig = c10d.init_process_group
    if getattr(orig, "_gputrace", False):
        return

    @_guarded
    def done(t0: int) -> None:
        st = get_state()
        if st is not None:
            st.rec.span("startup", "init_process_group", t0, st.now(), step=-1)
            flight.joined(st.rec, c10d._world.default_pg)

    @functools.wraps(orig)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        st = get_state()
        t0 = st.now() if st is not None else 0
        out = orig(*args, **kwargs)
        if t0:
            done(t0)
        return out

    init_process_group._gputrace = True  # type: ignore[attr-defined]
    c10d.init_process_group = init_process_group
    if getattr(dist, "init_process_group", None) is orig:
        dist.init_process_group = init_process_group
