"""Collectors: one module per source; each knows whether it is available and why not.

System collectors (host, infiniband, nvml) are sampled from outside the training process:
by `gputrace record` itself, or by the sampler subprocess of an embedded Session.
In-process collectors (torch, cupti or its torch.profiler fallback kineto, ranges) only record
spans.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # the in-process bootstrap imports this package: no pyarrow here
    from gputrace.trace.writer import Row


class Unavailable(Exception):
    """Raised by a collector's constructor with the one-line reason it cannot run."""


class SystemCollector(Protocol):
    name: str

    def settings(self) -> dict[str, Any]: ...

    def sample(self, t_ns: int) -> list[Row]: ...

    def close(self) -> None: ...


SYSTEM_COLLECTORS = ("host", "infiniband", "nvml")
IN_PROCESS_COLLECTORS = ("torch", "cupti", "tensorflow")
ALL_COLLECTORS = SYSTEM_COLLECTORS + IN_PROCESS_COLLECTORS


def make_system_collector(name: str, root_pid: int, host: str) -> SystemCollector:
    """Build one system collector, raising Unavailable with the reason when it cannot run."""
    if name == "host":
        from gputrace.collectors.host import HostCollector
        return HostCollector(root_pid, host)
    if name == "infiniband":
        from gputrace.collectors.infiniband import InfinibandCollector
        return InfinibandCollector(host)
    if name == "nvml":
        from gputrace.collectors.nvml import NvmlCollector
        return NvmlCollector(host)
    raise Unavailable(f"unknown collector {name!r}")


def in_process_status(name: str) -> str:
    """Why an in-process collector can or cannot run here, judged from outside the job."""
    if name == "torch":
        import importlib.util
        if importlib.util.find_spec("torch") is None:
            return "unavailable: torch is not installed"
        return "not used: the job did not import torch"
    if name == "tensorflow":
        import importlib.util
        if importlib.util.find_spec("tensorflow") is None and \
                importlib.util.find_spec("keras") is None:
            return "unavailable: neither tensorflow nor keras is installed"
        return "not used: the job imported neither tensorflow nor keras"
    if name == "cupti":
        from gputrace.collectors.cupti import availability
        why = availability()
        # a guess from outside: only a process of the job that started a GPU timeline
        # (CUPTI itself, or torch.profiler's) says which source ran
        return "not used: no process of the job started a GPU timeline" if why == "ok" \
            else why
    return f"unavailable: unknown collector {name!r}"


def start_gpu_timeline(rec: Any, torch: Any, mode: str) -> None:
    """GPU kernels and copies in this process: CUPTI directly (mode auto, cupti), else
    torch.profiler's Kineto (auto when CUPTI cannot be used and torch has CUDA; kineto).
    Whatever goes wrong (a torch without torch.cuda, ...) becomes the collector's status;
    the job never breaks."""
    from gputrace.collectors import cupti

    try:
        if mode in ("auto", "cupti") and cupti.start(rec, quiet=mode == "auto") is not None:
            return
        if mode not in ("auto", "kineto"):
            return
        why = str(rec.metadata.get("collectors", {}).get("cupti", {}).get("status", ""))
        cpu = os.environ.get("GPUTRACE_KINETO_CPU") == "1"
        if mode == "auto":
            if cupti.HELD_ELSEWHERE in why:   # another profiler, which Kineto would meet too
                print(f"gputrace: cupti: {why}; GPU kernels are not recorded", file=sys.stderr)
                return
            if not cpu and not torch.cuda.is_available():
                return                         # no GPU work to record
        from gputrace.collectors import kineto

        reason = "asked for (--gpu-timeline kineto)" if mode == "kineto" else f"CUPTI: {why}"
        if kineto.start(rec, torch, reason, force_cpu=cpu) is not None and mode == "auto":
            print(f"gputrace: GPU kernels come from torch.profiler ({reason})", file=sys.stderr)
    except Exception as e:  # noqa: BLE001
        rec.set_collector("cupti", f"unavailable: {type(e).__name__}: {e}".splitlines()[0])


# The sampler thread runs below the job's priority: on a machine the job keeps busy, a sample
# is taken a little late rather than taking a core from the job.
SAMPLER_NICE = 10
# longest wait between samples that is slept through: stop() waits at most this long
_SLEEP_MAX_S = 0.05


class Sampler:
    """Samples system collectors at a fixed rate on its own thread.

    The thread lives in a process that does no training (`record`, or the sampler
    subprocess of a Session), so the GIL of a busy training loop does not slow it down.
    """

    def __init__(self, collectors: list[SystemCollector], sink: Any, hz: float,
                 clock_now: Any) -> None:
        self.collectors = list(collectors)
        self.sink = sink  # a Recorder: add_rows()
        self.period_s = 1.0 / hz
        self.hz = hz
        self.now = clock_now
        self.ticks = 0
        self.failed: dict[str, str] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t_first = self._t_last = 0.0

    def start(self) -> None:
        self.tick()
        self._thread = threading.Thread(target=self._run, name="gputrace-sampler", daemon=True)
        self._thread.start()

    def tick(self) -> None:
        t = self.now()
        rows: list[Row] = []
        for c in list(self.collectors):
            try:
                rows.extend(c.sample(t))
            except Exception as e:  # a source that breaks mid-run is dropped, said once
                self.collectors.remove(c)
                self.failed[c.name] = f"stopped: {type(e).__name__}: {e}"
                print(f"gputrace: collector {c.name} stopped: {e}", file=sys.stderr)
        if rows:
            self.sink.add_rows(rows)
        self.ticks += 1
        self._t_last = time.perf_counter()
        if self.ticks == 1:
            self._t_first = self._t_last

    def _run(self) -> None:
        try:   # on Linux this thread only: the sample waits for a free core, not the job
            os.nice(SAMPLER_NICE)
        except OSError:
            pass
        nxt = time.perf_counter()
        while True:
            nxt += self.period_s
            now = time.perf_counter()
            # fell behind (a tick that ran late, a preempted thread): the missed ticks are
            # skipped rather than burst, and the next is at least half a period after the
            # last, so that no rate ("%" rows) is taken over a sliver of an interval
            if nxt - max(now, self._t_last + self.period_s / 2) < 0:
                nxt = max(now, self._t_last + self.period_s / 2)
            delay = nxt - now
            # a short wait sleeps (a third cheaper than an Event's timed wait, which every
            # tick at 100 Hz pays); a long one waits on the Event so stop() need not
            if delay > _SLEEP_MAX_S:
                self._stop.wait(delay)
            else:
                time.sleep(delay)
            if self._stop.is_set():
                return
            self.tick()

    def achieved_hz(self) -> float:
        span = self._t_last - self._t_first
        return (self.ticks - 1) / span if span > 0 and self.ticks > 1 else 0.0

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.tick()  # a last sample at the very end
        for c in self.collectors:
            try:
                c.close()
            except Exception:
                pass


def instrumentation_failed(collector: str, label: str, where: str, e: BaseException,
                           failed: list[str], rec: Any) -> None:
    """The one line an in-process collector's own failure becomes (the first only; `failed`
    remembers it), and its status in the trace; the training goes on."""
    if failed:
        return
    failed.append(where)
    why = f"{type(e).__name__}: {e}".splitlines()[0]
    print(f"gputrace: {label} instrumentation failed in {where} ({why}); training goes on, "
          f"its {label} spans may be incomplete", file=sys.stderr)
    if rec is not None:
        rec.set_collector(collector, f"failed in {where}: {why}")
