"""The system sampler's rows under a recording window: full rate inside the window, one
tick a second outside it (OUTSIDE_HZ).

The window is decided where the iterations are, in the job's processes: each one says in
its shard directory (`window-PID.json`, `publish`) where the windows it recorded in full
begin and end on the trace clock, once it knows (its flusher decides an iteration about a
second after it ends). The sampler's side (`Thinner`, between the Sampler and its
recorder) holds each tick HOLD_S before it decides it: inside a window that began by then,
or of a window of time (`--delay/--duration`, known from the start), the tick is written as
it is; else it is written only when OUTSIDE_S passed since the last tick written, its "%"
rows (rates over the interval since the previous tick: cpu.percent, proc.cpu_percent, GPU
utilisation) the time-weighted mean over the ticks it stands for, its other rows (counters,
cumulative: bytes, run-queue wait) as read, so a counter's difference between two ticks
kept is exact. With `--max-size SIZE` the sampler's ticks count in SIZE: the ticks left out
go to a ring of their own (`tail_recorder`: segment shards beside the sampler's, the oldest
deleted before they would hold more than SIZE / 2), so the most recent ones are there at
full rate, and the ticks kept (one a second, the window's at full rate) to another (KEPT,
SIZE / 2: `rings`), the most recent ones; the sampler's own shard holds its metadata and
the first tick.

The job's processes publish their windows through gputrace.window (publish)."""

from __future__ import annotations

import os
import time
from collections import deque
from typing import Any

from gputrace.window import published

HOLD_S = 20.0        # a tick waits this long for the job to say where its window began
OUTSIDE_S = 1.0      # one tick a second outside the window (OUTSIDE_HZ)
OUTSIDE_HZ = 1.0 / OUTSIDE_S
_READ_EVERY_S = 0.5  # the job's window files are listed at most this often
TAIL = "samples"     # the ring of the ticks left out (--max-size): samples.dN.spans
KEPT = "ticks"       # the ring of the ticks kept (--max-size): ticks.dN.spans


def _key(r: Any) -> tuple[Any, ...]:
    """A row's series: its category, name and device."""
    return (r[1], r[2], r[11] if len(r) > 11 else None)


class Thinner:
    """A sink for the Sampler (add_rows), in front of a Recorder: see the module's doc.
    `window`: the window's description (Window.describe(); None: no window, with
    `max_size` only); `shard_dir`: where the job's processes publish their windows."""

    def __init__(self, rec: Any, window: dict[str, Any] | None, shard_dir: str,
                 tail: Any = None, kept: Any = None) -> None:
        """`tail`: where the ticks left out go (tail_recorder), None: nowhere; `kept`: where
        the ticks kept go when not `rec` (a ring of its own: `rings`), closed with this."""
        self.rec, self.dir, self.tail, self.kept = kept or rec, shard_dir, tail, kept
        # with a ring of the ticks kept, the first goes to `rec` all the same: its shard is
        # made then, with the recording's metadata (a kill -9 later keeps it)
        self._first: Any = rec if kept is not None else None
        w = window or {}
        # a window that can begin later, where the job says (not --max-size's alone)
        opens = bool(set(w) - {"max_size", "run_phases", "run_unit", "run_phase_unit"})
        self.hold_ns = int(HOLD_S * 1e9) if opens else 0
        self.timed: tuple[int, int | None] | None = None
        if isinstance(w.get("origin_ns"), int) and "delay_s" in w:
            lo = w["origin_ns"] + int(float(w["delay_s"]) * 1e9)
            d = w.get("duration_s")
            self.timed = (lo, None if d is None else lo + int(float(d) * 1e9))
        self._held: deque[tuple[int, list[Any]]] = deque()
        self._ranges: list[tuple[int, int | None]] = []
        self._read_at = 0.0
        self._last_t: int | None = None      # the previous tick's time
        self._kept_t: int | None = None      # the last tick written
        self._acc: dict[Any, list[float]] = {}   # "%" rows: series -> [sum v*dt, sum dt]
        self.ticks_in = self.ticks_out = self.ticks_thinned = 0
        self._before: list[Any] | None = None   # the last tick thinned, if none was since
        self._was_in = False                    # the previous tick was in a window

    # -- the Sampler's sink ------------------------------------------------------------------
    def add_rows(self, rows: list[Any]) -> None:
        t = min(r[3] for r in rows)
        self._held.append((t, rows))
        self._decide(t - self.hold_ns)

    def close(self) -> None:
        """Decide every tick held (the job's last word read), close the ring."""
        self._read(force=True)
        self._decide(None)
        if self._before is not None:
            self._keep_tail(self._before)
            self._before = None
        if self.tail is not None:
            self.tail.close()
        if self.kept is not None:
            self.kept.close()

    def describe(self) -> dict[str, Any]:
        """What the sampler's metadata says of it."""
        return {"outside_hz": OUTSIDE_HZ, "ticks_in_window": self.ticks_in,
                "ticks_outside_kept": self.ticks_out, "ticks_outside_thinned":
                self.ticks_thinned, "ring": self.tail is not None}

    # -- the rule ----------------------------------------------------------------------------
    def _read(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._read_at >= _READ_EVERY_S:
            self._read_at = now
            self._ranges = published(self.dir)

    def _inside(self, t: int) -> bool:
        spans = self._ranges + ([self.timed] if self.timed else [])
        return any(lo <= t and (hi is None or t <= hi) for lo, hi in spans)

    def _decide(self, until: int | None) -> None:
        """Write or thin the ticks held from before `until` (None: all)."""
        if not self._held or (until is not None and self._held[0][0] > until):
            return
        self._read()
        while self._held and (until is None or self._held[0][0] <= until):
            t, rows = self._held.popleft()
            dt = 0 if self._last_t is None else max(t - self._last_t, 0)
            self._last_t = t
            inside = self._inside(t)
            if inside:
                if self._before is not None:   # the tick before the window's first: written
                    self.ticks_thinned -= 1    # (a counter is interpolated at its start)
                    self.ticks_out += 1
                    self._write(0, [self._averaged(r, 0) for r in self._before])
                self.ticks_in += 1
                self._write(t, rows)
            elif self._was_in or self._kept_t is None or t - self._kept_t >= OUTSIDE_S * 1e9:
                self.ticks_out += 1            # (the first after a window is written too)
                self._write(t, [self._averaged(r, dt) for r in rows])
            else:
                self.ticks_thinned += 1
                for r in rows:
                    if r[6] == "%" and r[5] == r[5]:
                        a = self._acc.setdefault(_key(r), [0.0, 0.0])
                        a[0] += r[5] * dt
                        a[1] += dt
                if self._before is not None:
                    self._keep_tail(self._before)
                self._before = rows
            self._was_in = inside

    def _averaged(self, r: Any, dt: int) -> Any:
        a = self._acc.get(_key(r))
        if r[6] != "%" or a is None or a[1] <= 0 or r[5] != r[5]:
            return r
        return (*r[:5], (a[0] + r[5] * dt) / (a[1] + dt), *r[6:])

    def _write(self, t: int, rows: list[Any]) -> None:
        if self._before is not None and t:   # a 1 Hz tick after ticks left out
            self._keep_tail(self._before)
        self._kept_t = max(t, self._kept_t or 0)
        self._acc.clear()
        self._before = None
        if self._first is not None:
            self._first.add_rows(rows)
            self._first = None
            return
        self.rec.add_rows(rows)

    def _keep_tail(self, rows: list[Any]) -> None:
        if self.tail is not None:
            self.tail.add_rows(rows)


def rings(shard_dir: str, max_size: int, clock: Any) -> tuple[Any, Any]:
    """With --max-size SIZE, the rings of the ticks left out and of those kept (started),
    SIZE / 2 each: every tick the sampler writes is in SIZE."""
    half = max_size // 2
    tail = tail_recorder(shard_dir, half, clock)
    try:
        return tail, tail_recorder(shard_dir, max_size - half, clock, KEPT)
    except BaseException:
        tail.close()
        raise


def tail_recorder(shard_dir: str, max_size: int, clock: Any, name: str = TAIL) -> Any:
    """A ring of the sampler's ticks with --max-size (started): a recorder of its own whose
    every row is detail (ring.RingWriter), the sampler's own metadata beside."""
    from gputrace.metadata import base_metadata
    from gputrace.recorder.core import Recorder
    from gputrace.recorder.ring import attach
    from gputrace.trace.frames import SUFFIX

    rec = Recorder(os.path.join(shard_dir, name + SUFFIX), base_metadata("sampler", rank=-1),
                   clock=clock, quiet=True)
    attach(rec, max_size)
    rec.ring_every_row = True
    return rec.start()
