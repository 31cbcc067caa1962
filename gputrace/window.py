"""A recording window: full detail for some iterations (`--steps START:COUNT`) or some
seconds (`--delay S --duration S`), and for every other iteration only its boundaries and
phase sums, packed as one `run` span per flush (see docs/format.md, "A windowed
recording").

Applied by the recorder's flusher, off the training loop's path: the hooks record as they
always do, and what falls outside the window is folded before it is written."""

from __future__ import annotations

import contextlib
import json
import os
import re
import threading
from typing import Any

from gputrace.collectors.memory import of_iteration
from gputrace.window_pack import PHASES, described, pack
from gputrace.window_pack import unpack as unpack  # the readers take it from here

ENV = "GPUTRACE_WINDOW"
_STEPS = re.compile(r"^(\d+):([1-9]\d*)$")
_KEEP_DECIDED = 4096
# spans of no iteration kept outside the window too: the process's life, its start-up, its
# evaluation passes and batches, its checkpoints and its loaders' starts and ends (a few per
# pass or save), from which the whole run's goodput is told
WHOLE_RUN = frozenset(("process", "startup", "evaluation", "checkpoint", "loader"))


def window_of(md: dict[str, Any]) -> dict[str, Any] | None:
    """The window a trace was recorded with (its metadata, or a shard's), None for none."""
    if isinstance(md.get("window"), dict):
        return md["window"]
    for sh in md.get("shards") or []:
        if isinstance(sh, dict) and isinstance(sh.get("window"), dict):
            return sh["window"]
    return None


class WindowError(ValueError):
    """A window that cannot be: said as one line."""


def parse_steps(text: str) -> tuple[int, int]:
    m = _STEPS.match(text.strip())
    if not m:
        raise WindowError(f"--steps is START:COUNT (e.g. 1000:20, COUNT at least 1), "
                          f"not {text!r}")
    return int(m.group(1)), int(m.group(2))


def make(steps: str | tuple[int, int] | None = None, delay_s: float | None = None,
         duration_s: float | None = None, origin_ns: int | None = None,
         on_demand: bool = False) -> Window | None:
    """The window asked for (None: record everything), every mistake a WindowError.
    `on_demand`: no window until `gputrace capture` opens one."""
    if steps is not None and (delay_s is not None or duration_s is not None):
        raise WindowError("--steps and --delay/--duration: choose one window")
    if on_demand and (steps is not None or delay_s is not None or duration_s is not None):
        raise WindowError("--on-demand opens windows when asked: leave out --steps, "
                          "--delay and --duration")
    if on_demand:
        return Window(on_demand=True)
    if steps is not None:
        start, count = parse_steps(steps) if isinstance(steps, str) else steps
        if start < 0 or count < 1:
            raise WindowError(f"--steps is START:COUNT with START >= 0 and COUNT >= 1, "
                              f"not {start}:{count}")
        return Window(steps=(int(start), int(count)))
    if delay_s is None and duration_s is None:
        return None
    delay = 0.0 if delay_s is None else float(delay_s)
    duration = float("inf") if duration_s is None else float(duration_s)
    if not (0 <= delay < 1e9) or delay != delay:
        raise WindowError(f"--delay takes seconds, 0 or more, not {delay_s}")
    if not duration > 0 or duration != duration:
        raise WindowError(f"--duration takes seconds greater than 0, not {duration_s}")
    return Window(delay_s=delay, duration_s=duration, origin_ns=origin_ns)


def from_env(env: dict[str, str] | None = None) -> Window | None:
    text = (os.environ if env is None else env).get(ENV)
    if not text:
        return None
    d = json.loads(text)
    if d.get("on_demand"):
        return Window(on_demand=True)
    if "steps" in d:
        return Window(steps=tuple(d["steps"]))
    return Window(delay_s=d["delay_s"], duration_s=d.get("duration_s") or float("inf"),
                  origin_ns=d.get("origin_ns"))


class Window:
    def __init__(self, steps: tuple[int, int] | None = None, delay_s: float = 0.0,
                 duration_s: float = float("inf"), origin_ns: int | None = None,
                 on_demand: bool = False) -> None:
        self.on_demand = on_demand
        self.steps = None if on_demand else steps
        # a window of time (--delay/--duration), else of steps (--steps, --on-demand)
        self.timed = steps is None and not on_demand
        self.delay_s, self.duration_s = delay_s, duration_s
        self.origin_ns = origin_ns
        self.lo: int | None = None       # a window of time: where it begins, in trace time
        self.hi: int | None = None       # ... and ends
        self.pending: dict[int, list[tuple[Any, ...]]] = {}   # step -> spans not yet decided
        self.pending_rows: dict[int, list[tuple[Any, ...]]] = {}
        self.decided: dict[int, bool] = {}   # step -> inside the window
        # iterations outside the window folded by this flush: (start, end, name, tid, step,
        # phase sums)
        self._folded: list[tuple[Any, ...]] = []
        self._lock = threading.Lock()
        # windows of steps (--steps, then those `gputrace capture` opened): [first step,
        # count, its first iteration's start, its last one's end]
        self.ranges: list[list[Any]] = [[*self.steps, None, None]] if self.steps else []
        self.capture: Any = None     # gputrace.recorder.capture.Answer, where it can reach this job
        self.last_decided = -1
        # the span describing the input, when it fell outside the window (False: carried)
        self._batch: Any = None
        # where the system sampler learns the windows' times (record.thin), and what it was
        # told last
        self.dir: str | None = None
        self._told: list[tuple[int, int | None]] = []

    def describe(self) -> dict[str, Any]:
        # what the run spans' args hold (gputrace.window_pack)
        d: dict[str, Any] = described()
        if self.on_demand:
            return {"on_demand": True, **d}
        if self.steps is not None:
            return {"steps": list(self.steps), **d}
        d.update(delay_s=self.delay_s, origin_ns=self.origin_ns)
        if self.duration_s != float("inf"):
            d["duration_s"] = self.duration_s
        return d

    def fresh(self) -> Window:
        """The same window with nothing pending (a forked child's)."""
        w = Window(self.steps, self.delay_s, self.duration_s, self.origin_ns, self.on_demand)
        w.lo, w.hi = self.lo, self.hi
        w.ranges = [list(c) for c in self.ranges]
        w.capture = self.capture.fresh() if self.capture is not None else None
        w.dir = self.dir
        return w

    def env(self) -> str:
        return json.dumps(self.describe())

    def attach(self, rec: Any) -> None:
        """Make `rec` write through this window (from its next flush)."""
        if self.timed and self.origin_ns is None:
            self.origin_ns = rec.clock.now_ns()
        if self.timed:
            self.lo = self.origin_ns + int(self.delay_s * 1e9)
            if self.duration_s != float("inf"):
                self.hi = self.lo + int(self.duration_s * 1e9)
        rec.metadata["window"] = self.describe()
        rec.window = self
        path = getattr(rec, "path", None)
        self.dir = os.path.dirname(os.path.abspath(path)) if isinstance(path, str) else None
        from gputrace.recorder import capture

        self.capture = capture.Answer.of(rec)

    # -- the rule ---------------------------------------------------------------------------
    def _in_steps(self, step: int) -> bool:
        return any(c[0] <= step < c[0] + c[1] for c in self.ranges)

    def wants(self, step: int, t_ns: int) -> bool:
        """Whether the iteration `step`, opening at t_ns, falls in the window as far as it is
        known when it opens (a collector that costs the job turns on for it). While a
        `gputrace capture` is being agreed, every iteration: the window may begin there."""
        held = self.capture is not None and self.capture.held is not None
        return held or self._in_steps(step) or self._in_timed(t_ns)

    def _inside(self, step: int, start: int, end: int) -> bool:
        if self._in_steps(step):
            return True
        if not self.timed:
            return False
        assert self.lo is not None
        return start >= self.lo and (self.hi is None or end <= self.hi)

    def _in_time(self, t: int) -> bool:
        """A span of no iteration (a loader worker's fetch, a GPU record): inside when it
        starts within the window's time, as far as it is known."""
        if any(c[2] is not None and c[2] <= t and (c[3] is None or t <= c[3])
               for c in self.ranges):
            return True
        return self._in_timed(t)

    def _in_timed(self, t: int) -> bool:
        """Within a window of time (`--delay`/`--duration`). A window of steps has times
        only once the writer thread decided its iterations: its end is not known while its
        last iteration is being written, so the step rule decides an iteration."""
        if not self.timed or self.lo is None or t < self.lo:
            return False
        return self.hi is None or t <= self.hi

    def _undecided(self, step: int, closing: bool) -> bool:
        """Spans of a step no iteration span ended: by their step (or time) alone."""
        spans = self.pending.pop(step, [])
        rows = self.pending_rows.pop(step, [])
        if not self.timed or self._in_steps(step):
            return self._inside(step, 0, 0)
        t = min([s[2] for s in spans] + [r[3] for r in rows], default=0)
        return self._in_time(t)

    def apply(self, spans: list[tuple[Any, ...]], rows: list[tuple[Any, ...]], closing: bool
              ) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
        """What of one flush is written: spans are (cat, name, start, end, tid, step, layer,
        bytes, args), rows the recorder's rows (kind, cat, name, start, end, ..., step at
        13). Iteration spans decide their step; the spans before them wait for it."""
        with self._lock:
            if self.capture is not None:     # the iterations it held, once agreed
                spans = self.capture.poll(self, closing, spans) + spans
            out = self._apply(spans, rows, closing)
            self._tell()
            return out

    def _tell(self) -> None:
        """Say where the windows recorded in full begin and end, once known, to the system
        sampler (it samples at full rate there only: gputrace.record.thin)."""
        known = [(c[2], c[3]) for c in self.ranges if c[2] is not None]
        if known != self._told and self.dir is not None:
            publish(self.dir, known)
            self._told = known

    def open(self, start: int, count: int) -> None:
        """A window of `count` iterations from step `start` (`gputrace capture`)."""
        self.ranges.append([start, count, None, None])

    def _apply(self, spans: list[tuple[Any, ...]], rows: list[tuple[Any, ...]],
               closing: bool) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
        out: list[tuple[Any, ...]] = []
        out_rows: list[tuple[Any, ...]] = []
        iters = []
        timeless = []
        for sp in spans:
            step = sp[5]
            if sp[0] == "iteration":
                iters.append(sp)
            elif step is None or step < 0:
                timeless.append(sp)
            elif step in self.decided:
                if self.decided[step]:
                    out.append(sp)
            else:
                self.pending.setdefault(step, []).append(sp)
        for r in rows:
            if r[0] != "span" and not of_iteration(r):
                out_rows.append(r)          # instants and samples: cheap, always kept
            elif r[13] is None or r[13] < 0:
                if self._in_time(r[3]):
                    out_rows.append(r)
            elif r[13] in self.decided:
                if self.decided[r[13]]:
                    out_rows.append(r)
            else:
                self.pending_rows.setdefault(r[13], []).append(r)
        held = self.capture.held if self.capture is not None else None
        for sp in sorted(iters, key=lambda s: s[2]):
            if held is not None and sp[5] is not None and sp[5] > held[0]:
                held[1].append(sp)      # a capture is being agreed: decided once it is
            else:
                self._iteration(sp, out, out_rows)
        # spans of no iteration by their time, once this flush's iterations gave the window
        # its times (an evaluation pass between two of its steps, flushed with them); the
        # whole run's spans wherever they fall (its goodput: analyzers.extras.goodput)
        out.extend(sp for sp in timeless if sp[0] in WHOLE_RUN or self._in_time(sp[2]))
        if closing:
            for step in sorted(set(self.pending) | set(self.pending_rows)):
                keep_sp, keep_rows = self.pending.get(step, []), self.pending_rows.get(step, [])
                if self._undecided(step, True):
                    out.extend(keep_sp)
                    out_rows.extend(keep_rows)
        out.extend(pack(self._folded))
        self._folded = []
        return out, out_rows

    def _iteration(self, sp: tuple[Any, ...], out: list[tuple[Any, ...]],
                   out_rows: list[tuple[Any, ...]]) -> None:
        step, start, end = sp[5], sp[2], sp[3]
        for old in [s for s in set(self.pending) | set(self.pending_rows) if s < step]:
            keep_sp, keep_rows = self.pending.get(old, []), self.pending_rows.get(old, [])
            if self._undecided(old, False):
                out.extend(keep_sp)
                out_rows.extend(keep_rows)
        mine = self.pending.pop(step, [])
        mine_rows = self.pending_rows.pop(step, [])
        if any(s[2] < start for s in mine):
            # spans of its step before it began (an evaluation batch's, which counts no
            # step): decided by their time, never folded into its phase sums
            out.extend(s for s in mine if s[2] < start and self._in_time(s[2]))
            mine = [s for s in mine if s[2] >= start]
        inside = self._inside(step, start, end)
        self.decided[step] = inside
        self.last_decided = max(self.last_decided, step)
        if len(self.decided) > _KEEP_DECIDED:
            for k in sorted(self.decided)[:len(self.decided) - _KEEP_DECIDED]:
                del self.decided[k]
        if inside:
            self._carry_batch(mine)
            for c in self.ranges:
                if c[0] <= step < c[0] + c[1]:
                    c[2] = start if c[2] is None else min(c[2], start)
                    if step == c[0] + c[1] - 1:
                        c[3] = end
            out.extend(mine)
            out.append(sp)
            out_rows.extend(mine_rows)
            return
        if self._batch is None:
            self._batch = next((s for s in mine if s[0] == "forward" and s[8]
                                and '"batch"' in s[8]), None)
        self._folded.append((start, end, sp[1], sp[4], step,
                             phase_sums(mine, (start, end, sp[4]))))

    def _carry_batch(self, mine: list[tuple[Any, ...]]) -> None:
        """The input's description (collectors.torch.batch) is written once, on the first
        outermost forward: made outside the window, it moves to the first such forward of
        the same model inside it, where the analysis finds it."""
        b = self._batch
        if b is None or b is False:
            return
        for i, s in enumerate(mine):
            if s[0] == "forward" and s[1] == b[1] and (s[6] is None or s[6] < 1):
                try:
                    args = json.loads(s[8]) if s[8] else {}
                    args["batch"] = json.loads(b[8])["batch"]
                except (ValueError, TypeError, KeyError):
                    return
                mine[i] = (*s[:8], json.dumps(args, separators=(",", ":")), *s[9:])
                self._batch = False      # carried once
                return


def phase_sums(spans: list[tuple[Any, ...]], bounds: tuple[int, int, Any] | None = None
               ) -> dict[str, int]:
    """ns per phase of one iteration's spans: io, h2d, update and comm spans whole (comm:
    busy time, hidden or not), forward and backward only the passes (layer < 1). With the
    iteration's (start, end, thread): also `after`, its time after its last phase where it
    began at a batch request (analyzers.extras.after_step: a data wait only on its own thread)."""
    sums = dict.fromkeys(PHASES, 0)
    last, requested = -1, False
    for sp in spans:
        cat = sp[0]
        if cat in sums and (cat not in ("forward", "backward") or sp[6] is None or sp[6] < 1):
            sums[cat] += max(0, sp[3] - sp[2])
        if bounds is not None and (cat in sums or cat == "framework") and \
                (cat != "io" or sp[4] == bounds[2]):
            last = max(last, sp[3], sp[2])
            requested = requested or (cat == "io" and sp[2] == bounds[0])
    if bounds is not None and requested and 0 <= last < bounds[1]:
        sums["after"] = bounds[1] - last
    return sums


# -- where the windows are, for the system sampler (gputrace.record.thin) ---------------------
PREFIX = "window-"


def publish(shard_dir: str, ranges: list[tuple[int, int | None]]) -> None:
    """This process's windows recorded in full, [(start_ns, end_ns or None: still open)],
    where the sampler reads them. Never raises (the job goes on)."""
    path = os.path.join(shard_dir, f"{PREFIX}{os.getpid()}.json")
    tmp = f"{path}.tmp"
    with contextlib.suppress(OSError, ValueError):
        with open(tmp, "w") as f:
            json.dump({"ranges": [list(r) for r in ranges]}, f)
        os.replace(tmp, path)


def published(shard_dir: str) -> list[tuple[int, int | None]]:
    """Every process's windows, as `publish` wrote them."""
    out: list[tuple[int, int | None]] = []
    try:
        names = [n for n in os.listdir(shard_dir)
                 if n.startswith(PREFIX) and n.endswith(".json")]
    except OSError:
        return out
    for n in names:
        try:
            with open(os.path.join(shard_dir, n)) as f:
                d = json.load(f)
            out += [(int(lo), None if hi is None else int(hi)) for lo, hi in d["ranges"]]
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return out
