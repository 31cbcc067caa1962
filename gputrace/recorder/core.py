"""In-process recorder: cheap span appends on the hot path, batches written off it."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any

from gputrace.fmt import reason
from gputrace.metadata import hostname
from gputrace.recorder.clock import Clock
from gputrace.recorder.loop import Iterations

if TYPE_CHECKING:
    from gputrace.recorder.ring import RingWriter
    from gputrace.trace.frames import FrameWriter
    from gputrace.trace.writer import Row

_native_tid = threading.get_native_id
# pthread_self(): GPU tools name threads by it. CUPTI's runtime records carry its low 32 bits
# (unsigned), Kineto's JSON the same bits as a signed int32 for threads it has not mapped.
_pthread_id = threading.get_ident
PTHREAD_MASK = 0xFFFFFFFF
# A batch is written at least once a second (a killed run loses at most the last second);
# every 0.8 s keeps a fifth of a second for a late flush. A flush writes what was drained
# as it is (trace.frames: ~50 us for 180 spans); building Arrow batches in the job cost
# ~0.7 ms each and about as much again in the loop's thread after (its caches refilled).
FLUSH_INTERVAL_S = 0.8
_PHASE_CATS = frozenset(("io", "h2d", "forward", "backward", "update", "comm"))


class Recorder(Iterations):
    """Collects rows for one shard file and writes them in batches from a flusher thread.

    Hot path (`span`, `phase`): two clock reads and a list append. The file (a shard in
    `trace.frames`' format, which `gputrace.load` and the merge read) is opened at the first
    flush that has rows, so processes that record nothing leave no shard.
    """

    def __init__(self, path: str, metadata: dict[str, Any],
                 flush_interval_s: float = FLUSH_INTERVAL_S,
                 clock: Clock | None = None, quiet: bool = False) -> None:
        self.path = path
        self.metadata = metadata
        self.clock = clock or Clock()
        self.metadata["start"] = self.clock.start
        self.host: str = metadata.get("host") or hostname()
        self.rank: int = int(metadata.get("rank", -1))
        self.pid = os.getpid()
        self.flush_interval_s = flush_interval_s
        self.step = 0            # index of the current (or next) iteration
        self._iter_start: int | None = None
        self._iter_live = False  # a phase was recorded since the open iteration began
        # native TID -> low 32 bits of pthread_self, for every thread that recorded a span
        self.threads: dict[int, int] = {}
        # called with the time at close(), before the last open iteration is settled
        self.close_hooks: list[Any] = []
        # deques: append and popleft are atomic, so a flush never loses a racing append
        self._spans: deque[tuple[Any, ...]] = deque()
        # spans timed with time.perf_counter_ns (hot hooks skip the clock's method call);
        # the flusher moves them onto the trace clock
        self._perf_spans: deque[tuple[Any, ...]] = deque()
        self.push_perf = self._perf_spans.append
        self._rows: deque[Row] = deque()
        self._swap = threading.Lock()
        self._write = threading.Lock()
        self._writer: FrameWriter | RingWriter | _DeadWriter | None = None
        self._closed = self._closing = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._dir_lock: int | None = None
        self.quiet = quiet       # write errors are left to the owner to say (write_error)
        self._dropped = 0
        self.rows_written = 0
        # called by the flusher with the spans just drained; return extra rows to write
        # (the CUPTI collector attributes GPU records to these phase spans)
        self.flush_hooks: list[Any] = []
        # asked at each flush, until it answers, for (rank, world size) where the job learns
        # them in-process (torch.distributed: mp.spawn, Lightning's or any launcher that
        # sets no variables); see `learn_rank`
        self.rank_source: Any = None
        # a recording window (gputrace.window): what falls outside it is folded at flush
        self.window: Any = None
        # bytes of iterations' detail kept on disk, a ring of the latest (gputrace.recorder.ring)
        self.max_size: int | None = None
        self.ring_every_row = False   # with max_size: every row is detail (record.thin's)
        # collectors.memory.PhaseMemory: the memory at each phase's start and end (`mark`)
        self.memory: Any = None

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> Recorder:
        if self._dir_lock is None:
            # while this process lives, `gputrace recover` leaves its directory alone
            from gputrace.trace import shards

            self._dir_lock = shards.hold(os.path.dirname(os.path.abspath(self.path)))
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="gputrace-flush", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        # Until the file exists, look for the first rows every 50 ms: a job killed in its
        # first second still leaves what it did.
        # The interval runs from the start of the last flush: one that took longer (the
        # first, on a busy machine, can take a second) is followed by the next at once, so
        # what arrived meanwhile is not left a whole interval more.
        last = time.monotonic()
        while True:
            interval = self.flush_interval_s if self._writer is not None \
                else min(0.05, self.flush_interval_s)
            if self._stop.wait(max(0.0, last + interval - time.monotonic())):
                return
            last = time.monotonic()
            self.flush()

    def set_collector(self, name: str, status: str, **settings: Any) -> None:
        self.metadata.setdefault("collectors", {})[name] = {"status": status, **settings}

    def learn_rank(self) -> None:
        """Ask `rank_source` for this process's rank and world size; once it answers, every
        event from then on carries that rank, and the shard's metadata says it
        (`rank_from`), so the reader gives the events written before it the same rank."""
        source = self.rank_source
        if source is None:
            return
        try:
            got = source()
        except Exception:  # noqa: BLE001 - e.g. the group being destroyed: ask again later
            return
        if got is None:
            return
        self.rank_source = None
        rank, world = got
        md = self.metadata
        if rank == self.rank and md.get("world_size") == world:
            return
        self.rank = rank
        md["rank"], md["world_size"], md["rank_from"] = rank, world, "torch.distributed"
        with self._write:
            if self._writer is not None:
                self._writer.put_metadata(md)

    def flush(self) -> None:
        if self.rank_source is not None:
            self.learn_rank()
        with self._swap:
            spans = _drain(self._spans)
            perf = _drain(self._perf_spans)
            rows = _drain(self._rows)
        offset = self.clock.from_perf(0)
        if perf and self.flush_hooks:   # the hooks see every span on the trace clock
            spans += _on_clock(perf, offset)
            perf = []
        for hook in list(self.flush_hooks):
            try:
                rows.extend(hook(spans, self._closed))
            except Exception as e:  # a collector bug must not stop recording
                self.flush_hooks.remove(hook)
                print(f"gputrace: {getattr(hook, '__qualname__', hook)} failed and is off: "
                      f"{type(e).__name__}: {e}", file=sys.stderr)
        if self.window is not None:
            try:
                spans, rows = self.window.apply(spans + _on_clock(perf, offset), rows,
                                                self._closed)
                perf = []
            except Exception as e:  # noqa: BLE001 - the window's bug: record everything
                self.window = None
                spans += _on_clock(perf, offset)
                perf = []
                print(f"gputrace: the recording window failed and is off: {reason(e)}",
                      file=sys.stderr)
        n = len(spans) + len(perf) + len(rows)
        if not n:
            return
        try:
            with self._write:
                if self._writer is None:
                    self._writer = self._open()
                self._writer.write(self.host, self.rank, self.pid, offset, spans, perf, rows)
                self.rows_written = self._writer.rows_written
        except Exception as e:  # noqa: BLE001 - e.g. a value that cannot be written
            self.left_out(n, reason(e))

    def _open(self) -> FrameWriter | RingWriter | _DeadWriter:
        from gputrace.trace.frames import FrameWriter

        try:
            if self.max_size:
                from gputrace.recorder.ring import RingWriter

                return RingWriter(self.path, self.metadata, self.max_size, quiet=self.quiet,
                                  every_row=self.ring_every_row)
            return FrameWriter(self.path, self.metadata, quiet=self.quiet)
        except Exception as e:  # noqa: BLE001 - a recorder never breaks its process
            dead = _DeadWriter(reason(e))
            if not self.quiet:
                print(f"gputrace: cannot create {self.path}: {dead.error}; this process "
                      "records nothing", file=sys.stderr)
            return dead

    @property
    def write_error(self) -> str | None:
        """Why this recorder stopped writing (None while it writes)."""
        return getattr(self._writer, "error", None)

    def close(self) -> None:
        if self._closed or self._closing:
            return
        self._closing = True
        t = self.clock.now_ns()
        for hook in list(self.close_hooks):
            try:
                hook(t)
            except Exception as e:  # noqa: BLE001 - a collector bug must not lose the trace
                print(f"gputrace: {getattr(hook, '__qualname__', hook)} failed at exit: "
                      f"{type(e).__name__}: {e}", file=sys.stderr)
        if self._iter_live:
            self.close_iteration(t)
        self._iter_start = None   # opened where the last one ended, and nothing since
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        # only now: the final flush (its hooks told `final`) is this thread's, never the
        # flusher's last one (the torch.profiler fallback stops its session there, which
        # must be on the thread that started it: on the flusher it crashed the process)
        self._closed = True
        end = Clock.anchor()
        # a process with something to say (events, or a collector's status) leaves a shard
        if self._writer is not None or self._spans or self._perf_spans or self._rows or \
                self.metadata.get("collectors"):
            self.instant("user", "gputrace.end", args={"monotonic_ns": end["monotonic_ns"],
                                                       "realtime_ns": end["realtime_ns"]})
        self.flush()
        with self._write:
            if self._writer is not None:
                self._writer.close(self.metadata)
        if self._dir_lock is not None:
            # closed, never unlocked: a forked child shares the lock and keeps it
            os.close(self._dir_lock)
            self._dir_lock = None

    def reset_after_fork(self, path: str) -> None:
        """In a forked child: own shard, fresh buffers, fresh thread; keep the parent's step."""
        self.path = path
        self.pid = os.getpid()
        self.metadata = dict(self.metadata, pid=self.pid, role="process")
        # cleared in place: hooks hold the bound appends (push_perf)
        self._spans.clear()
        self._perf_spans.clear()
        self._rows.clear()
        self.flush_hooks = []   # the parent's GPU subscriptions do not carry over a fork
        self.iteration_watchers = ()
        self.close_hooks = []
        self.threads = {}
        self._swap, self._write = threading.Lock(), threading.Lock()
        if self._writer is not None:
            self._writer.abandon()   # the parent's shard: it goes on writing it
        self._writer = None
        self._closed = self._closing = False
        self._iter_start = None
        if self.window is not None:   # the parent's pending spans are the parent's
            self.window = self.window.fresh()
        self._stop = threading.Event()
        self._thread = None
        self.start()

    # -- recording (thread-safe: list.append is atomic) -------------------------------------
    def now_ns(self) -> int:
        return self.clock.now_ns()

    def span(self, cat: str, name: str, start_ns: int, end_ns: int, *, layer: int = -1,
             nbytes: int | None = None, args: dict[str, Any] | str | None = None,
             step: int | None = None, tid: int | None = None) -> None:
        if args is not None and args.__class__ is not str:
            # default=str: a value JSON cannot hold is kept as its text, never an exception
            args = json.dumps(args, separators=(",", ":"), default=str)
        if tid is None:
            tid = _native_tid()
            if tid not in self.threads:
                self._new_thread(tid)
        if cat in _PHASE_CATS:
            self._iter_live = True
        self._spans.append((cat, name, start_ns, end_ns, tid,
                            self.step if step is None else step, layer, nbytes, args))

    def left_out(self, n: int, why: str) -> None:
        """n events that cannot be written: said once, counted."""
        if not self._dropped:
            print(f"gputrace: could not write {n} events to {self.path}: {why}; they are "
                  "left out", file=sys.stderr)
        self._dropped += n

    def _new_thread(self, tid: int) -> None:
        """Once per thread: how GPU tools name it (pthread_self), kept for matching their
        launch records to this thread's phases, and written as a `gputrace.thread` row."""
        pt = _pthread_id() & PTHREAD_MASK
        self.threads[tid] = pt
        self.row("instant", "user", "gputrace.thread", self.clock.now_ns(), tid=tid,
                 args=json.dumps({"pthread_id": pt, "name": threading.current_thread().name}))

    def row(self, kind: str, cat: str, name: str, start_ns: int, end_ns: int | None = None,
            value: float | None = None, unit: str | None = None, *, pid: int | None = None,
            tid: int = -1, device: int = -1, stream: int = -1, step: int = -1,
            layer: int = -1, nbytes: int | None = None, src_kind: str | None = None,
            dst_kind: str | None = None, corr: int | None = None,
            args: str | None = None) -> None:
        self._rows.append((kind, cat, name, start_ns, end_ns, value, unit, self.host, self.rank,
                           self.pid if pid is None else pid, tid, device, stream, step, layer,
                           nbytes, src_kind, dst_kind, corr, args))

    def peek_spans(self) -> list[tuple[Any, ...]]:
        """The spans not yet flushed, left in place (a copy; appends may race it)."""
        return _copy(self._spans) + _on_clock(_copy(self._perf_spans), self.clock.from_perf(0))

    def add_rows(self, rows: list[Row]) -> None:
        self._rows.extend(rows)

    def sample(self, cat: str, name: str, value: float, unit: str, *, device: int = -1,
               t_ns: int | None = None) -> None:
        self.row("sample", cat, name, self.now_ns() if t_ns is None else t_ns, value=value,
                 unit=unit, device=device)

    def instant(self, cat: str, name: str, args: dict[str, Any] | None = None) -> None:
        self.row("instant", cat, name, self.now_ns(), tid=_native_tid(), step=self.step,
                 args=json.dumps(args, default=str) if args else None)


def _copy(d: deque[Any]) -> list[Any]:
    for _ in range(8):
        try:
            return list(d)
        except RuntimeError:   # appended to while copied: try again
            continue
    return []


def _on_clock(spans: list[tuple[Any, ...]], offset: int) -> list[tuple[Any, ...]]:
    """Spans timed with perf_counter_ns, on the trace clock."""
    return [(c, n, s + offset, e + offset, *rest) for c, n, s, e, *rest in spans]


def _drain(d: deque[Any]) -> list[Any]:
    pop = d.popleft
    return [pop() for _ in range(len(d))]


class _DeadWriter:
    """The writer of a shard that could not be created: takes everything, keeps nothing."""

    rows_written = 0

    def __init__(self, error: str) -> None:
        self.error = error

    def write(self, *events: Any) -> None:
        pass

    def close(self, metadata: dict[str, Any] | None = None) -> None:
        pass

    def abandon(self) -> None:
        pass


_current: Recorder | None = None


def current() -> Recorder | None:
    return _current


def set_current(rec: Recorder | None) -> None:
    global _current
    _current = rec
