"""The embedded API: Session, and module-level phase/iterate/step on the current recorder."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Iterator
from types import TracebackType
from typing import Any, TypeVar

from gputrace import recorder as _recorder
from gputrace.collectors import SYSTEM_COLLECTORS
from gputrace.collectors.ranges import phase

T = TypeVar("T")


class Session:
    """Record a run from inside the training script.

    Starts an in-process recorder and a small sampler subprocess for the system collectors,
    and merges both into `path` on exit. Under `gputrace record`, it joins that recording
    instead (the record's own trace gets everything) and `path` is not written.
    """

    def __init__(self, path: str = "trace.arrow", *, hz: float = 100.0,
                 collectors: Iterable[str] = SYSTEM_COLLECTORS, sampler: bool = True,
                 flush_interval_s: float = 0.5) -> None:
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
        out_dir = os.path.dirname(os.path.abspath(self.path))
        self._dir = tempfile.mkdtemp(prefix=f".{os.path.basename(self.path)}.",
                                     suffix=".shards", dir=out_dir)
        md = _recorder.base_metadata("session")
        from gputrace.probe import embed

        embed(md)
        rec = _recorder.Recorder(os.path.join(self._dir, f"process-{os.getpid()}.arrow"), md,
                                 flush_interval_s=self.flush_interval_s)
        rec.set_collector("ranges", "ok")
        self.recorder = rec.start()
        self._owned = True
        _recorder.set_current(rec)
        if self.sampler and self.collectors:
            env = dict(os.environ, GPUTRACE_DISABLE="1")
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "gputrace.record.sampler", "--pid", str(os.getpid()),
                 "--out", os.path.join(self._dir, "sampler.arrow"), "--hz", str(self.hz),
                 "--collectors", ",".join(self.collectors)],
                env=env, stdout=subprocess.PIPE)
            assert self._proc.stdout is not None
            self._proc.stdout.readline()  # "ready": the first sample is taken
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        if not self._owned or self.recorder is None:
            return
        self._owned = False
        rec = self.recorder
        rec.close()
        if _recorder.current() is rec:
            _recorder.set_current(None)
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        assert self._dir is not None
        from gputrace.record.merge import merge_shards

        try:
            self.result = merge_shards(self._dir, self.path, top=dict(rec.metadata))
        except Exception as e:
            print(f"gputrace: could not write {self.path}: {e}; shards kept in {self._dir}",
                  file=sys.stderr)
            return

    # delegation to the recorder
    def phase(self, cat: str, name: str | None = None, layer: int | None = None,
              bytes: int | None = None) -> phase:
        return phase(cat, name, layer, bytes)

    def iterate(self, iterable: Iterable[T]) -> Iterator[T]:
        assert self.recorder is not None, "use the Session inside `with`"
        return self.recorder.iterate(iterable)

    def step(self) -> None:
        if self.recorder is not None:
            self.recorder.step_done()

    def record_span(self, cat: str, name: str, start_ns: int, end_ns: int, **kw: Any) -> None:
        if self.recorder is not None:
            self.recorder.span(cat, name, start_ns, end_ns, **kw)

    def record_sample(self, cat: str, name: str, value: float, unit: str, **kw: Any) -> None:
        if self.recorder is not None:
            self.recorder.sample(cat, name, value, unit, **kw)

    def now_ns(self) -> int:
        assert self.recorder is not None
        return self.recorder.now_ns()


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
        rec.span(cat, name, start_ns, end_ns, **kw)


def record_sample(cat: str, name: str, value: float, unit: str, **kw: Any) -> None:
    rec = _recorder.current()
    if rec is not None:
        rec.sample(cat, name, value, unit, **kw)
