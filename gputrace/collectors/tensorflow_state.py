"""The TensorFlow collector's state and the helpers its hook modules share: the recording's
state per process (`_State`: the profiler window, the step clock, the spans it writes),
each failure of ours as one line (`_fail`, `_safe`), the window asked for. The collector
(collectors/tensorflow.py) makes it and installs the hooks (tensorflow_hooks, _keras,
_keras_data, _optimizers, _saves, _eval), which import this module, never the collector."""

from __future__ import annotations

import functools
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from typing import Any

from gputrace.collectors import instrumentation_failed
from gputrace.recorder.core import Recorder

_state: _State | None = None
_failed: list[str] = []
DEFAULT_WINDOW = (5, 10)
PROFILER_SPAN = "TensorFlow profiler (gputrace)"
# An async op's event (a collective's, on TensorFlow's collective_ops thread) is recorded
# when that thread leaves the op's trace scope, after it woke the step's caller: a profiler
# stopped as the window's last step returns can miss that step's last collective (a step
# ending in an all-reduce, profiled alone and stopped at once beside four CPU hogs: 16 of
# 500 profiles without it; 0 of 300 with 10 ms before the stop, 0 of 300 with 100 ms). The
# profiler stops this long after that step, in gputrace's own span, outside the steps.
STOP_GRACE_S = 0.1


def _fail(where: str, e: BaseException) -> None:
    instrumentation_failed("tensorflow", "TensorFlow", where, e, _failed,
                           _state.rec if _state is not None else None)


def _safe(fn: Any) -> Any:
    """A hook of ours whose failure is one line on stderr, never the job's exception."""
    @functools.wraps(fn)
    def safe(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - a profiler never takes down the job
            _fail(fn.__name__, e)
            return None
    return safe


def window_from_env(value: str | None) -> tuple[int, int] | None:
    """`START:COUNT`, `all` (0 and unbounded) or `off` (None)."""
    if value is None or value == "":
        return DEFAULT_WINDOW
    if value == "off":
        return None
    if value == "all":
        return (0, -1)
    try:
        a, b = value.split(":")
        start, count = int(a), int(b)
        if start < 0 or count < 1:
            raise ValueError
        return start, count
    except ValueError:
        print(f"gputrace: GPUTRACE_TF_STEPS={value!r} is not START:COUNT, all or off; "
              f"using {DEFAULT_WINDOW[0]}:{DEFAULT_WINDOW[1]}", file=sys.stderr)
        return DEFAULT_WINDOW


def _multi_worker() -> bool:
    """TF_CONFIG names a cluster of more than one task (MultiWorkerMirroredStrategy)."""
    try:
        cluster = json.loads(os.environ.get("TF_CONFIG") or "{}").get("cluster") or {}
        return sum(len(v) for v in cluster.values() if isinstance(v, list)) > 1
    except (ValueError, AttributeError, TypeError):
        return False


def subtract(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of the intervals `a` that no interval of `b` covers."""
    out: list[tuple[int, int]] = []
    cuts = sorted(b)
    for s, e in sorted(a):
        at = s
        for bs, be in cuts:
            if be <= at or bs >= e:
                continue
            if bs > at:
                out.append((at, bs))
            at = max(at, be)
            if at >= e:
                break
        if at < e:
            out.append((at, e))
    return out


class _State:
    def __init__(self, rec: Recorder, steps: str | None) -> None:
        """`steps`: GPUTRACE_TF_STEPS as given (None or empty: the default window)."""
        self.rec = rec
        self.now = rec.clock.now_ns
        self.asked = bool(steps)            # a window was asked for
        self.window = window = window_from_env(steps)
        self.k = 0                          # the next step's index
        self.open_t: int | None = None      # start of the open iteration
        self.graph = False                  # its phases come from the profiler
        self.profiling = False
        # no step will be profiled (`off`, a multi-worker job): steps are iterations whose
        # phases are not known (time in no phase), not steps left out beside profiled ones
        self.unprofiled = window is None
        self.logdir: str | None = None
        self.windows: list[tuple[int, int]] = []   # iterations written while profiling
        self.profiled_steps = 0
        self.optimizers: set[str] = set()
        self.in_fit = 0
        self.tf_ops = True                  # the loop runs TensorFlow ops (not Keras on torch)
        self.tape_t: int | None = None      # an eager tape was entered
        self.loop_tid: int | None = None
        self.lock = threading.RLock()
        self.tls = threading.local()
        self.calling: Any = None            # the tf.function the loop is calling
        self.notes: list[str] = []
        self.converted: dict[str, int] = {}
        self.tf_start: Any = None           # TensorFlow's own profiler start (unwrapped)
        self.comm_bytes: dict[str, int] = {}    # all-reduce op (graph name) -> its bytes
        self.fw_from: int | None = None     # fit: Keras's own work since then (framework)
        self.fw_outside: list[tuple[int, int]] = []   # ... outside its step function
        self.fit_windows: list[tuple[int, int]] = []  # fit's iterations while profiling
        self.fit_aside: Any = None          # fit's callback: its open step ends at t (a save)
        self.passes: Any = None             # a custom loop's evaluation (tensorflow_eval)

    # -- iterations ----------------------------------------------------------------------
    def framework_until(self, t: int) -> None:
        """Keras's own per-step work in fit (the loop, its logs, the callbacks, the step
        function's call), from where it began to t: a `framework` span on the loop's
        thread."""
        if self.fw_from is not None and t > self.fw_from:
            self.rec.span("framework", "keras", self.fw_from, t)
            if self.profiling:
                self.fw_outside.append((self.fw_from, t))
        self.fw_from = None

    def begin(self, t: int) -> None:
        if self.open_t is None:
            if self.k == 0 and self.window == (0, -1) and self.tf_ops and \
                    not self.profiling and self.start_profiler():
                t = self.now()      # `all`: from the first step, its start left out
            self.open_t = t
            self.rec.step = self.k

    def end_step(self, t: int, graph: bool, n: int = 1, reopen: bool = True) -> None:
        """The open iteration ends at t (n steps, split evenly); window control; the next
        begins at t (or after the profiler's start or stop)."""
        with self.lock:
            start = self.open_t if self.open_t is not None else t
            self.open_t = None
            from gputrace.recorder.core import _native_tid

            if self.k == 0:
                _refresh_rank(self.rec)
                self.skip_multi_worker()
            self.loop_tid = _native_tid()
            for j in range(n):
                s = start + (t - start) * j // n
                e = start + (t - start) * (j + 1) // n
                if graph and not self.profiling and not self.unprofiled:
                    self.rec.span("user", "step (not profiled)", s, e, step=self.k)
                else:
                    self.rec.span("iteration", "iteration", s, e, step=self.k)
                    if self.profiling:
                        self.windows.append((s, e))
                        self.profiled_steps += 1
                        if self.in_fit and graph:
                            self.fit_windows.append((s, e))
                self.k += 1
            acted = self._window()
            if reopen:
                self.open_t = self.now() if acted else t
                self.rec.step = self.k

    def _window(self) -> bool:
        """Start or stop the profiler at this step boundary; True if it did."""
        w = self.window
        if w is None or not self.tf_ops:
            return False
        first, count = w
        if not self.profiling and self.k >= first and not self.profiled_steps:
            return self.start_profiler()
        if self.profiling and count > 0 and self.profiled_steps >= count:
            self.stop_profiler()
            return True
        return False

    def skip_multi_worker(self) -> bool:
        """No window asked for, and a multi-worker job: its profiler is not started (True:
        no step is profiled). TensorFlow's profiler, stopped in a worker of a multi-worker
        job while its collectives run, sometimes kills that worker ("free(): invalid
        pointer"; seen here in 1 of 8 busy 2-worker runs with the job's own profiler and no
        gputrace): a profiler never takes down the job, so only a window asked for starts it."""
        if self.unprofiled or self.asked or not _multi_worker():
            return self.unprofiled
        self.notes.append("TensorFlow's profiler not started in a multi-worker job "
                          "(--tf-steps START:COUNT starts it)")
        print("gputrace: a multi-worker TensorFlow job: its profiler is not started (it can "
              "crash a worker); iterations are recorded without phases, --tf-steps "
              "START:COUNT profiles those steps", file=sys.stderr)
        self.window = None
        self.unprofiled = True
        self._status()
        return True

    def _own(self, op: str, t0: int) -> None:
        """gputrace's own work at a step boundary (the profiler's start, or its stop and the
        profile's conversion): a `user` span on the loop's thread, outside the steps (the
        whole run's `other`)."""
        self.rec.span("user", PROFILER_SPAN, t0, self.now(), step=-1, args={"op": op})

    def start_profiler(self) -> bool:
        if self.skip_multi_worker():
            return False
        t0 = self.now()
        try:
            import tensorflow as tf

            self.logdir = tempfile.mkdtemp(prefix="gputrace-tf-")
            (self.tf_start or tf.profiler.experimental.start)(self.logdir)
            self._own("start", t0)
        except Exception as e:  # noqa: BLE001 - e.g. a profiler the job started itself
            why = f"{type(e).__name__}: {e}".splitlines()[0]
            self.notes.append(f"TensorFlow's profiler did not start: {why}")
            print(f"gputrace: TensorFlow's profiler did not start ({why}); iterations are "
                  "recorded without phases", file=sys.stderr)
            self.window = None
            return False
        self.profiling = True
        return True

    def stop_profiler(self) -> None:
        if not self.profiling:
            return
        self.profiling = False
        self.window = None          # one window per process
        t0 = self.now()
        try:
            import tensorflow as tf

            time.sleep(STOP_GRACE_S)
            tf.profiler.experimental.stop()
            self._convert()
            self._own("stop", t0)
        except Exception as e:  # noqa: BLE001 - never break the job
            why = f"{type(e).__name__}: {e}".splitlines()[0]
            self.notes.append(f"profile not converted: {why}")
            print(f"gputrace: TensorFlow profile not converted ({why}); its phases are lost",
                  file=sys.stderr)
        finally:
            if self.logdir and not os.environ.get("GPUTRACE_TF_KEEP"):
                shutil.rmtree(self.logdir, ignore_errors=True)
        # the shard's metadata is written at its first flush: what the window held is a row
        self.rec.instant("user", "tensorflow.profile", args={
            "steps": self.profiled_steps, "rows": self.converted,
            **({"notes": self.notes} if self.notes else {})})

    def _convert(self) -> None:
        from gputrace.importers import tfprof, tfprof_files
        from gputrace.importers.common import Rows

        assert self.logdir is not None
        keep = os.environ.get("GPUTRACE_TF_KEEP")
        r = self.rec
        if keep:
            # one directory per rank: workers on one host write the same file names
            shutil.copytree(self.logdir, keep if r.rank < 0 else
                            os.path.join(keep, f"rank{r.rank}"), dirs_exist_ok=True)
        rows = Rows()
        executions: list[tuple[int, int]] = []
        for path in tfprof_files.profile_files(self.logdir):
            hosts, devices = tfprof_files.read_xspace(path)
            for h in hosts:
                c = tfprof.convert(h, rows, rank=r.rank, pid=r.pid, loop_tid=self.loop_tid,
                                   optimizers=self.optimizers, eager=False, iterations=False,
                                   windows=self.windows, comm_bytes=self.comm_bytes)
                for k, v in c.counts.items():
                    self.converted[k] = self.converted.get(k, 0) + v
                executions += c.executions
        if executions:
            # fit's step function, inside: what the loop did outside its graph's execution
            # (the tf.function call's dispatch, Keras's Optional of the step's outputs)
            for s, e in subtract(subtract(self.fit_windows, executions), self.fw_outside):
                r.span("framework", "keras: step dispatch", s, e, tid=self.loop_tid)
            self.converted["framework"] = len(self.fit_windows)
            for d in devices:
                self.converted["gpu"] = self.converted.get("gpu", 0) + tfprof.gpu_rows(
                    d, rows, rank=r.rank, optimizers=self.optimizers)
        out = rows.tuples(host=r.host)
        if out:
            r.add_rows(out)

    def _status(self) -> None:
        w = self.window
        window = "off" if w is None else "all" if w[1] < 0 else f"{w[0]}:{w[1]}"
        self.rec.set_collector("tensorflow", "ok", profiler_steps=window)

    def finish(self, t: int) -> None:
        """The recording closes: the open iteration of a loop that never ended another
        is dropped (what follows the last step is no iteration); the profiler stops."""
        with self.lock:
            if self.passes is not None:     # a custom loop's evaluation pass in progress
                self.passes.close()
            self.open_t = None
            self.stop_profiler()


def _refresh_rank(rec: Recorder) -> None:
    """A script that sets TF_CONFIG itself (after gputrace started) has its rank now."""
    if rec.rank >= 0:
        return
    from gputrace.metadata import tf_config_rank

    rank, world = tf_config_rank()
    if rank >= 0:
        rec.rank = rank
        rec.metadata["rank"], rec.metadata["world_size"] = rank, world
