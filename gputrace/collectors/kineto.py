"""GPU timeline from torch.profiler (Kineto) when CUPTI cannot be used directly.

The fallback for jobs where cupti-python is missing or does not match the CUDA that torch
was built with: Kineto ships inside torch and always matches it. It runs one profiler
session with only the CUDA activity (kernels, memcpy, memset, CUDA runtime calls; no CPU
operator events, no shapes, no stacks) from the moment the job imports torch until it
exits, or until the job starts a profiler of its own: gputrace's session then stops first
and says so in one line, so the job's own profiling works as it would without gputrace.
With a recording window its collection is on only for the iterations the window wants
(`toggle_collection_dynamic`, collectors.gate).

Kineto keeps its records until the session stops, so they reach the trace at that point
(not every second as with CUPTI). They are converted by the Kineto importer, with each
kernel, memcpy and memset attributed to the innermost gputrace phase open on the
launching thread at launch (runtime call matched by correlation id), NCCL kernels as
`comm`: the same rows the CUPTI collector writes.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import tempfile
import threading
from typing import Any

from gputrace.collectors.gate import WindowGate

_active: KinetoCollector | None = None


def availability(torch: Any) -> str:
    """'ok', or 'unavailable: <one-line reason>'."""
    try:
        from torch.profiler import ProfilerActivity, supported_activities
    except Exception as e:  # noqa: BLE001 - a torch without the profiler
        return f"unavailable: torch.profiler cannot be imported ({e})"
    if not torch.cuda.is_available():
        return "unavailable: torch sees no CUDA device"
    if ProfilerActivity.CUDA not in supported_activities():
        return "unavailable: this torch's profiler has no CUDA activity"
    return "ok"


class KinetoCollector(WindowGate):
    name = "kineto"
    label = "torch.profiler fallback"

    def __init__(self, recorder: Any, torch: Any, activities: list[Any] | None = None) -> None:
        from torch.profiler import ProfilerActivity, profile

        self.torch = torch
        self.recorder = recorder
        self.pid = os.getpid()
        self.activities = activities or [ProfilerActivity.CUDA]
        self.prof = profile(activities=self.activities, record_shapes=False,
                            profile_memory=False, with_stack=False)
        self.phases: list[tuple[Any, int, int, str]] = []
        self.iters: list[tuple[int, int, int]] = []
        self.loop_tid: int | None = None        # the thread that records iterations
        self.stopped = False
        self.out: list[tuple[Any, ...]] = []      # converted rows for the next flush
        self.lock = threading.Lock()
        self.counts: dict[str, int] = {}
        self.error: str | None = None

    def start(self, reason: str) -> None:
        global _active
        self.prof.start()
        self.thread = threading.get_ident()   # the session stops on this thread only
        _active = self
        _yield_to_the_job(self.torch)
        self.recorder.flush_hooks.append(self.on_flush)
        self.watch_window()
        # runs before torch's own exit handlers (registered earlier, at its import)
        atexit.register(self.finish)
        self.recorder.set_collector(
            "cupti", f"ok: torch.profiler (Kineto) fallback, {reason}", source="torch.profiler",
            activities=[str(a).split(".")[-1] for a in self.activities],
            delivery="when the profiler session stops (job exit, or the job's own profiler)")

    def _switch(self, on: bool) -> None:
        """Kineto's collection on or off for the session's activities; never after the
        session stopped (the job's own profiler may be running)."""
        if not self.stopped:
            self.prof.toggle_collection_dynamic(on, self.activities)

    # -- the recorder's flusher ---------------------------------------------------------------
    def _take(self, spans: list[tuple[Any, ...]], phases: list[Any], iters: list[Any]) -> None:
        from gputrace.importers.common import PHASES

        key_pid = self.recorder.pid
        for sp in spans:
            cat, _, s, e, tid, step = sp[:6]
            if cat == "iteration":
                iters.append((s, e, step))
                self.loop_tid = tid
            elif cat in PHASES:
                phases.append(((key_pid, tid), s, e, cat))

    def on_flush(self, spans: list[tuple[Any, ...]], final: bool) -> list[tuple[Any, ...]]:
        with self.lock:
            self._take(spans, self.phases, self.iters)
        if final and threading.get_ident() == self.thread:
            self.finish()
        with self.lock:
            rows, self.out = self.out, []
        return rows

    def finish(self) -> None:
        """Stop the session (once, in the process that started it) and convert its records."""
        global _active
        with self.lock:
            if self.stopped or os.getpid() != self.pid or \
                    threading.get_ident() != getattr(self, "thread", None):
                return     # Kineto's session stopped on another thread crashes the process
            self.stopped = True
            # spans the flusher has not drained yet still tell where launches were made
            phases, iters = list(self.phases), list(self.iters)
            self._take(self.recorder.peek_spans(), phases, iters)
        if _active is self:
            _active = None
        rows: list[tuple[Any, ...]] = []
        fd, path = tempfile.mkstemp(prefix="gputrace-kineto-", suffix=".json")
        os.close(fd)
        try:
            self.prof.stop()
            self.prof.export_chrome_trace(path)
            keep = os.environ.get("GPUTRACE_KINETO_KEEP")
            if keep:
                self._keep(path, keep, phases, iters)
            rows = self.convert(path, phases, iters)
        except Exception as e:  # noqa: BLE001 - never break the job at its exit
            self.error = f"{type(e).__name__}: {e}".splitlines()[0]
            print(f"gputrace: torch.profiler fallback: {self.error}; its GPU records are lost",
                  file=sys.stderr)
        finally:
            try:
                os.unlink(path)
            except OSError:
                pass
        rows.append(self._summary())
        with self.lock:
            self.out.extend(rows)

    def _keep(self, path: str, keep: str, phases: list[Any], iters: list[Any]) -> None:
        """GPUTRACE_KINETO_KEEP=PATH: the session's Kineto JSON as torch exported it, and
        beside it (PATH.context.json) what its conversion is given: real records to replay
        through the same conversion on a machine without a GPU."""
        import shutil

        shutil.copyfile(path, keep)
        r = self.recorder
        with open(keep + ".context.json", "w") as f:
            json.dump({"pid": r.pid, "rank": r.rank, "loop_tid": self.loop_tid,
                       "threads": {str(k): v for k, v in r.threads.items()},
                       "phases": [[list(p[0]), p[1], p[2], p[3]] for p in phases],
                       "iters": [list(i) for i in iters]}, f)

    def convert(self, path: str, phases: list[tuple[Any, int, int, str]],
                iters: list[tuple[int, int, int]]) -> list[tuple[Any, ...]]:
        """A Kineto JSON of this process -> trace rows attributed to gputrace's phases:
        phases ((pid, tid), start, end, cat) and iterations (start, end, step)."""
        from gputrace.importers import kineto
        from gputrace.importers.common import Rows
        from gputrace.trace.schema import COLUMN_NAMES

        rows = Rows()
        r = self.recorder
        # Kineto names threads it saw no operator on (all of them, with only the CUDA
        # activity on) by their pthread id: the recorder knows which native TID that is
        threads = {pt: tid for tid, pt in list(r.threads.items())}
        loop = self.loop_tid
        if loop is None and phases:
            loop = max({p[0][1] for p in phases}, key=lambda t: sum(p[0][1] == t for p in phases))
        loops = {r.pid: (r.pid, loop)} if loop is not None else None
        counts = kineto.read(path, r.rank, rows, phases=phases, iters=iters, gpu_only=True,
                             threads=threads, loops=loops)
        # all of the session's records are this process's
        out = rows.tuples(host=r.host, pid=r.pid)
        cat = COLUMN_NAMES.index("cat")
        for row in out:
            self.counts[row[cat]] = self.counts.get(row[cat], 0) + 1
        self.counts["events_read"] = int(counts.get("events", 0))
        return out

    def _summary(self) -> tuple[Any, ...]:
        r = self.recorder
        args = {"records": self.counts, "source": "torch.profiler",
                "window_switches": self.switches}
        if self.error:
            args["error"] = self.error
        return ("instant", "user", "cupti.summary", r.now_ns(), None, None, None, r.host,
                r.rank, r.pid, -1, -1, -1, -1, -1, None, None, None, None, json.dumps(args),
                None)


def _yield_to_the_job(torch: Any) -> None:
    """When the job starts a profiler of its own, stop gputrace's session first (Kineto runs
    one session per process), once, and say so."""
    cls = torch.autograd.profiler.profile
    if getattr(cls._prepare_trace, "_gputrace", False):
        return
    inner = cls._prepare_trace

    def _prepare_trace(self: Any, *a: Any, **kw: Any) -> Any:
        col = _active
        if col is not None and self is not getattr(col.prof, "profiler", None):
            print("gputrace: the job starts its own torch.profiler; the gputrace fallback "
                  "session stops here (GPU records after this point are the job's)",
                  file=sys.stderr)
            col.finish()
        return inner(self, *a, **kw)

    _prepare_trace._gputrace = True  # type: ignore[attr-defined]
    cls._prepare_trace = _prepare_trace


def start(recorder: Any, torch: Any, reason: str, force_cpu: bool = False) -> KinetoCollector | None:
    """Start the fallback if torch can profile CUDA here; otherwise say why and go on.

    `force_cpu` runs the same session with the CPU activity on a machine without a GPU
    (its operator events are not kept): the whole path, minus GPU records, for tests."""
    status = "ok" if force_cpu else availability(torch)
    if status != "ok":
        recorder.set_collector("cupti", f"{status} (torch.profiler fallback; {reason})")
        return None
    try:
        acts = None
        if force_cpu:
            from torch.profiler import ProfilerActivity
            acts = [ProfilerActivity.CPU]
        col = KinetoCollector(recorder, torch, acts)
        col.start(reason)
        return col
    except Exception as e:  # noqa: BLE001 - a profiler already running, ...
        why = f"{type(e).__name__}: {e}".splitlines()[0]
        recorder.set_collector("cupti", f"unavailable: torch.profiler fallback failed: {why}")
        print(f"gputrace: torch.profiler fallback unavailable: {why}; GPU kernels are not "
              "recorded", file=sys.stderr)
        return None
