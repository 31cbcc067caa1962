"""The embedded API: Session, and module-level phase/iterate/step on the current recorder."""

from __future__ import annotations

import contextlib
import operator
import os
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from types import TracebackType
from typing import Any, TypeVar

from gputrace.collectors import SYSTEM_COLLECTORS
from gputrace.collectors.ranges import phase
from gputrace.fmt import reason
from gputrace.metadata import base_metadata
from gputrace.recorder import core as _recorder
from gputrace.trace import frames

T = TypeVar("T")


class Session:
    """Record a run from inside the training script.

    Starts an in-process recorder and a small sampler subprocess for the system collectors,
    and merges both into `path` on exit. Under `gputrace record`, it joins that recording
    instead (the record's own trace gets everything) and `path` is not written.
    `steps=(START, COUNT)` (or "START:COUNT"), or `delay`/`duration` in seconds: a recording
    window, as `record --steps`/`--delay`/`--duration`; `max_size` ("5MB" or bytes): at
    most that much of the latest iterations' detail on disk, as `record --max-size`
    (docs/recording.md, "Long jobs").
    """

    def __init__(self, path: str = "trace.arrow", *, hz: float = 50.0,
                 collectors: Iterable[str] = SYSTEM_COLLECTORS, sampler: bool = True,
                 flush_interval_s: float = _recorder.FLUSH_INTERVAL_S,
                 steps: str | tuple[int, int] | None = None, delay: float | None = None,
                 duration: float | None = None, max_size: str | int | None = None) -> None:
        from gputrace.recorder.ring import parse_size
        from gputrace.window import make

        # as record's --steps/--delay/--duration/--max-size (a ValueError when it cannot be)
        self.window = make(steps, delay, duration)
        self.max_size = None if max_size is None else parse_size(max_size)
        self.path = os.fspath(path)
        self.hz = hz
        self.collectors = list(collectors)
        self.sampler = sampler
        self.flush_interval_s = flush_interval_s
        self.recorder: _recorder.Recorder | None = None
        self._owned = False
        self._dir: str | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self.result: Any = None

    def __enter__(self) -> Session:
        existing = _recorder.current()
        if existing is not None:
            self.recorder = existing
            print(f"gputrace: Session joins the running `gputrace record`; {self.path} is "
                  "not written (the record's trace holds everything)", file=sys.stderr)
            return self
        try:
            self._start()
        except Exception as e:  # noqa: BLE001 - a profiler never takes down the job
            print(f"gputrace: cannot record {self.path}: {reason(e)}; the job runs untraced",
                  file=sys.stderr)
            self._abandon()
        return self

    def _start(self) -> None:
        from gputrace.trace import shards

        self._dir = shards.create(self.path)
        md = base_metadata("session")
        from gputrace.probe import embed

        embed(md)
        # its write errors are said once, at close, with where the data is
        shard = os.path.join(self._dir, f"process-{os.getpid()}{frames.SUFFIX}")
        rec = _recorder.Recorder(shard, md, flush_interval_s=self.flush_interval_s, quiet=True)
        rec.set_collector("ranges", "ok")
        if self.window is not None:
            self.window.attach(rec)
        if self.max_size is not None:
            from gputrace.recorder import ring

            ring.attach(rec, self.max_size)
        with contextlib.suppress(Exception):   # recorded all the same
            from gputrace.collectors import memory

            memory.install(rec)
        self.recorder = rec.start()
        self._owned = True
        _recorder.set_current(rec)
        if self.sampler and self.collectors:
            self._start_sampler()

    def _start_sampler(self) -> None:
        assert self._dir is not None
        env = dict(os.environ, GPUTRACE_DISABLE="1")
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "gputrace.record.sampler", "--pid", str(os.getpid()),
                 "--out", os.path.join(self._dir, "sampler" + frames.SUFFIX),
                 "--hz", str(self.hz),
                 "--collectors", ",".join(self.collectors),
                 *(["--window", self.window.env()] if self.window is not None else []),
                 *(["--max-size", str(self.max_size)] if self.max_size else [])],
                env=env, stdout=subprocess.PIPE)
        except OSError as e:
            print(f"gputrace: the sampler did not start ({reason(e)}); {self.path} gets "
                  "no host, disk or network samples", file=sys.stderr)
            return
        assert self._proc.stdout is not None
        self._proc.stdout.readline()  # "ready": the first sample is taken

    def _abandon(self) -> None:
        """Undo a start that failed half way: no recorder, no sampler, no directory."""
        rec, self.recorder = self.recorder, None
        if rec is not None:
            if _recorder.current() is rec:
                _recorder.set_current(None)
            try:
                rec.close()
            except Exception:  # noqa: BLE001
                pass
        self._owned = False
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None
        if self._dir is not None:
            import shutil

            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        if not self._owned or self.recorder is None:
            return
        self._owned = False
        rec = self.recorder
        if _recorder.current() is rec:
            _recorder.set_current(None)
        assert self._dir is not None
        from gputrace.record.sampler import WRITE_FAILED

        lost = None
        try:
            rec.close()
            lost = rec.write_error
            if self._proc is not None:
                self._proc.terminate()
                try:
                    self._proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    self._proc.kill()
                    self._proc.wait()
                if self._proc.returncode == WRITE_FAILED:
                    lost = lost or "the sampler could not write its samples"
            from gputrace.record.merge import merge_shards

            self.result = merge_shards(self._dir, self.path, top=dict(rec.metadata))
            if self.max_size is not None:
                from gputrace.recorder.ring import dropped_line

                line = dropped_line(self.result.path)
                if line:
                    print(line, file=sys.stderr)
        except Exception as e:  # noqa: BLE001 - a profiler never takes down the job
            print(f"gputrace: could not write {self.path}: {lost or reason(e)}; what was "
                  f"recorded until then is kept in {self._dir} (`gputrace recover {self.path}` "
                  "once that is fixed)", file=sys.stderr)
            return
        if lost:
            print(f"gputrace: {self.path} stops early: {lost}", file=sys.stderr)

    # delegation to the recorder
    def phase(self, cat: str, name: str | None = None, layer: int | None = None,
              bytes: int | None = None) -> phase:
        return phase(cat, name, layer, bytes)

    def iterate(self, iterable: Iterable[T]) -> Iterator[T]:
        # untraced (the trace could not be started): the items pass through
        return iter(iterable) if self.recorder is None else self.recorder.iterate(iterable)

    def step(self) -> None:
        if self.recorder is not None:
            self.recorder.step_done()

    def record_span(self, cat: str, name: str, start_ns: int, end_ns: int, **kw: Any) -> None:
        if self.recorder is not None:
            _user_span(self.recorder, cat, name, start_ns, end_ns, kw)

    def record_sample(self, cat: str, name: str, value: float, unit: str, **kw: Any) -> None:
        if self.recorder is not None:
            _user_sample(self.recorder, cat, name, value, unit, kw)

    def now_ns(self) -> int:
        return time.time_ns() if self.recorder is None else self.recorder.now_ns()


def iterate(iterable: Iterable[T]) -> Iterator[T]:
    """Like Session.iterate on the current recorder; passes items through without one."""
    rec = _recorder.current()
    return iter(iterable) if rec is None else rec.iterate(iterable)


def step() -> None:
    rec = _recorder.current()
    if rec is not None:
        rec.step_done()


def record_span(cat: str, name: str, start_ns: int, end_ns: int, **kw: Any) -> None:
    """Thread-safe: record a finished span (trace-clock ns) on the current recorder."""
    rec = _recorder.current()
    if rec is not None:
        _user_span(rec, cat, name, start_ns, end_ns, kw)


def record_sample(cat: str, name: str, value: float, unit: str, **kw: Any) -> None:
    rec = _recorder.current()
    if rec is not None:
        _user_sample(rec, cat, name, value, unit, kw)


def _user_span(rec: _recorder.Recorder, cat: str, name: str, start_ns: int,
               end_ns: int | None, kw: dict[str, Any]) -> None:
    """A span from the job's own code: numpy integers made Python ones, values the trace
    cannot hold said once and the span left out (a shard is written as it is:
    `trace.frames`)."""
    kw = dict(kw, start_ns=start_ns, end_ns=end_ns)
    why = "start_ns None is not an integer" if start_ns is None else _as_ints(kw)
    if why is None:
        rec.span(str(cat), str(name), **kw)
    else:
        rec.left_out(1, why)


def _user_sample(rec: _recorder.Recorder, cat: str, name: str, value: float, unit: str,
                 kw: dict[str, Any]) -> None:
    """A sample from the job's own code, checked as `_user_span`."""
    kw = dict(kw)
    why = _as_ints(kw)
    try:
        value = float(value)
    except (TypeError, ValueError):
        why = why or f"value {value!r} is not a number"
    if why is None:
        rec.sample(str(cat), str(name), value, str(unit), **kw)
    else:
        rec.left_out(1, why)


_NOT_INTS = frozenset(("args",))


def _as_ints(kw: dict[str, Any]) -> str | None:
    """Make the integer values in kw (numpy's too; None: not given) Python ints, in place;
    why one cannot be in the trace's int64 columns, or None."""
    for key, v in kw.items():
        if v is None or key in _NOT_INTS:
            continue
        try:
            if isinstance(v, bool | float):
                raise TypeError
            v = kw[key] = operator.index(v)
        except TypeError:
            return f"{key} {v!r} is not an integer"
        if not -2**63 <= v < 2**63:
            return f"{key} {v} is out of the 64-bit range"
    return None
