"""`record --max-size SIZE`: each process keeps at most SIZE of detail on disk, a ring of
its most recent iterations, and every iteration's time and phase sums for the whole run.

A process writes two kinds of shard. Its own shard (the recorder's path) gets its metadata,
instants and samples, the spans of no iteration, and for every iteration one entry in a
packed `run` span (`window.pack`: times, phase sums to 1 %, ~5 bytes). The detail of
iterations (their spans and rows) goes into segment shards beside it (`NAME.dN.spans`),
each a complete shard with the same metadata: when the newest holds more than SIZE/4, the
next iteration starts a new one, and the oldest are deleted while the segments hold more
than SIZE. Segments are cut and deleted whole, at iteration boundaries only (an iteration's
spans, written before its `iteration` span, all go into the segment its `iteration` span
does), so an iteration has all of its detail or none, and every file left is readable
after kill -9. `analyze` reads it as a windowed trace (`window.max_size`): an `iteration`
span wins over the `run` entry of the same step."""

from __future__ import annotations

import os
import sys
from typing import Any

from gputrace.collectors.memory import of_iteration
from gputrace.fmt import count, reason
from gputrace.trace.frames import SUFFIX, FrameWriter
from gputrace.window import PHASES, pack, phase_sums
from gputrace.window_pack import described

ENV = "GPUTRACE_MAX_SIZE"
MIN_SIZE = 64_000        # a segment holds a copy of the metadata (a few KB) and some detail
_SEGMENTS = 4           # a new segment when the newest holds more than SIZE / _SEGMENTS


class MaxSizeError(ValueError):
    """A --max-size that cannot be: said as one line."""


def parse_size(text: str | int | float) -> int:
    """'5MB', '500KB', '1GiB' or a number of bytes, at least MIN_SIZE."""
    if isinstance(text, int | float) and not isinstance(text, bool):
        n = float(text)
    else:
        from gputrace.fmt import AnalysisError, parse_bytes

        try:
            n = parse_bytes(str(text), "--max-size")
        except AnalysisError as e:
            raise MaxSizeError(str(e).replace("64MiB or 1GB", "500KB or 5MB")) from None
    if not MIN_SIZE <= n < 1 << 62:
        raise MaxSizeError(f"--max-size is at least {size_text(MIN_SIZE)}, not {text!r}")
    return int(n)


def size_text(n: int) -> str:
    for unit, k in (("GB", 10**9), ("MB", 10**6), ("KB", 10**3), ("GiB", 1 << 30),
                    ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= k and n % k == 0:
            return f"{n // k}{unit}"
    return f"{n / 1e6:.3g}MB" if n >= 10**6 else f"{n / 1e3:.3g}KB"


def attach(rec: Any, max_size: int) -> None:
    """Make `rec` keep at most max_size of detail (from the file it opens): its metadata says
    so under `window` (with a recording window, beside what that one says)."""
    rec.max_size = int(max_size)
    mark(rec.metadata, max_size)


def mark(md: dict[str, Any], max_size: int) -> None:
    """Say in a shard's metadata that its run was recorded with --max-size."""
    win = md.get("window")
    if not isinstance(win, dict):
        win = described()
    md["window"] = {**win, "max_size": int(max_size)}


def from_env(rec: Any, env: dict[str, str] | None = None) -> None:
    text = (os.environ if env is None else env).get(ENV)
    if text:
        attach(rec, int(text))


def _step(x: Any) -> int:
    return x if x is not None and x >= 0 else -1


class RingWriter:
    """A FrameWriter to the recorder (write, put_metadata, close, abandon, error,
    rows_written) that splits each flush between the process's shard and the segments."""

    def __init__(self, path: str, metadata: dict[str, Any], max_size: int,
                 quiet: bool = False, every_row: bool = False) -> None:
        self.base = FrameWriter(path, metadata, quiet=quiet)   # raises as FrameWriter does
        self.path, self.metadata, self.max_size = path, metadata, int(max_size)
        # every row is detail, cut at any flush (the sampler's full-rate ticks outside a
        # window: gputrace.record.thin): the process's shard holds its metadata only
        self.every_row = every_row
        self.quiet = quiet
        self.segments: list[FrameWriter] = []     # oldest first
        self._made = 0
        self._sums: dict[int, dict[str, int]] = {}   # step -> phase sums of its spans so far
        self.deleted = 0                          # segments deleted
        self.seg_error: str | None = None

    @property
    def error(self) -> str | None:
        return self.base.error

    @property
    def rows_written(self) -> int:
        return self.base.rows_written + sum(s.rows_written for s in self.segments)

    def write(self, host: str, rank: int, pid: int, perf_offset: int,
              spans: list[tuple[Any, ...]], perf_spans: list[tuple[Any, ...]],
              rows: list[tuple[Any, ...]]) -> None:
        """One flush: what belongs to no iteration and a `run` entry per iteration into the
        process's shard, each iteration's detail into the newest segment."""
        if self.every_row:
            self._detail(host, rank, pid, [(list(spans), list(rows))])
            self._rotate()
            return
        base_spans: list[tuple[Any, ...]] = []
        base_rows: list[tuple[Any, ...]] = []
        groups: dict[int, tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]] = {}
        its: list[tuple[Any, ...]] = []
        for sp in (*spans, *((c, n, s + perf_offset, e + perf_offset, *rest)
                             for c, n, s, e, *rest in perf_spans)):
            step = _step(sp[5])
            if sp[0] == "run" or step < 0:
                base_spans.append(sp)
                continue
            if sp[0] == "iteration":
                its.append(sp)
            groups.setdefault(step, ([], []))[0].append(sp)
        for r in rows:
            step = _step(r[13]) if (r[0] == "span" or of_iteration(r)) and len(r) > 13 \
                else -1
            if step < 0:
                base_rows.append(r)
            else:
                groups.setdefault(step, ([], []))[1].append(r)
        for step, (sps, _) in groups.items():
            if any(sp[0] in PHASES for sp in sps):
                got = phase_sums(sps)
                have = self._sums.setdefault(step, dict.fromkeys(PHASES, 0))
                for p in PHASES:
                    have[p] += got[p]
        its.sort(key=lambda sp: (sp[5], sp[2]))
        folded = [(sp[2], sp[3], sp[1], sp[4], sp[5],
                   self._sums.pop(sp[5], dict.fromkeys(PHASES, 0))) for sp in its]
        if its:   # sums of steps no iteration span will close any more
            last = its[-1][5]
            for k in [k for k in self._sums if k <= last]:
                del self._sums[k]
        base_spans.extend(pack(folded))
        self.base.write(host, rank, pid, 0, base_spans, [], base_rows)
        # the detail, cut after each iteration (a segment ends only there)
        order = sorted(groups)
        for sp in its:
            chunk = [k for k in order if k <= sp[5] and k in groups]
            if chunk:
                self._detail(host, rank, pid, [groups.pop(k) for k in chunk])
                self._rotate()
        rest = [groups.pop(k) for k in order if k in groups]
        if rest:
            self._detail(host, rank, pid, rest)

    def _detail(self, host: str, rank: int, pid: int,
                parts: list[tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]]) -> None:
        seg = self.segments[-1] if self.segments else self._new_segment()
        if seg is None:
            return
        out = list(seg.encode(host, rank, pid, 0, [sp for p in parts for sp in p[0]], [],
                              [r for p in parts for r in p[1]]))
        self._trim(sum(len(f) for f, _ in out))   # room made before, never after
        for frame, n in out:
            seg.put(frame, n)

    def _rotate(self) -> None:
        if self.segments and self.segments[-1].written > self.max_size // _SEGMENTS:
            self._new_segment()

    def _new_segment(self) -> FrameWriter | None:
        if self.seg_error is not None or self.base.error is not None:
            return None
        self._made += 1
        path = f"{self.path[:-len(SUFFIX)]}.d{self._made}{SUFFIX}"
        try:
            seg = FrameWriter(path, self._segment_md(), quiet=self.quiet)
        except Exception as e:  # noqa: BLE001 - the detail is lost, not the run's times
            self.seg_error = reason(e)
            if not self.quiet:
                print(f"gputrace: cannot create {path}: {self.seg_error}; from now on only "
                      "the iterations' times are recorded", file=sys.stderr)
            return None
        self.segments.append(seg)
        self._trim()
        return seg

    def _segment_md(self) -> dict[str, Any]:
        return dict(self.metadata, segment=self._made)

    def _trim(self, coming: int = 0) -> None:
        """Delete the oldest segments while they would hold more than max_size with
        `coming` bytes more (never the newest)."""
        while len(self.segments) > 1 and \
                sum(s.written for s in self.segments) + coming > self.max_size:
            old = self.segments.pop(0)
            old.abandon()
            try:
                os.unlink(old.path)
            except OSError:
                pass
            self.deleted += 1

    def put_metadata(self, metadata: dict[str, Any]) -> None:
        self.metadata = metadata
        self.base.put_metadata(metadata)
        for s in self.segments:
            s.put_metadata(dict(metadata, segment=_number(s.path)))
        self._trim()

    def close(self, metadata: dict[str, Any] | None = None) -> None:
        # the segments keep the metadata they have (their rank's): the process's shard
        # has the last word, and a segment closed grows by its closing frame only
        for s in self.segments:
            s.close()
        self.base.close(metadata)

    def abandon(self) -> None:
        for s in self.segments:
            s.abandon()
        self.base.abandon()


def _number(path: str) -> int:
    try:
        return int(path[:-len(SUFFIX)].rsplit(".d", 1)[1])
    except (IndexError, ValueError):
        return 0


def dropped_line(path: str) -> str | None:
    """What --max-size dropped, from a merged trace (None: not recorded with --max-size, or
    it cannot be read): the iterations of each rank kept in detail, and how many earlier
    ones keep their times only."""
    from gputrace.trace.parts import metadata_of
    from gputrace.window import window_of

    md = metadata_of(path)
    win = window_of(md) if md is not None else None
    if not isinstance(win, dict) or not isinstance(win.get("max_size"), int):
        return None
    try:
        kept = kept_by_rank(path)
    except Exception as e:  # noqa: BLE001 - a line of the summary, not the trace
        return f"gputrace: --max-size {size_text(win['max_size'])}: cannot tell what was " \
            f"dropped ({reason(e)})"
    same: dict[tuple[int, int, int, int], list[int]] = {}   # ranks that kept the same
    for rank, k in sorted(kept.items()):
        same.setdefault(k, []).append(rank)
    parts = []
    for (lo, hi, n, earlier), ranks in same.items():
        who = ("the job" if ranks == [-1] else f"rank {ranks[0]}" if len(ranks) == 1
               else "ranks " + ", ".join(map(str, ranks)))
        if n == 0:
            parts.append(f"no iteration of {who} in detail; {count(earlier, 'iteration')} "
                         "keep their times only")
        elif earlier:
            parts.append(f"kept the detail of iterations {lo}..{hi} of {who}; "
                         f"{earlier} earlier one{'s' if earlier != 1 else ''} keep"
                         f"{'' if earlier != 1 else 's'} their times only")
        else:
            parts.append(f"kept the detail of every iteration of {who} ({lo}..{hi})")
    if not parts:
        return None
    return f"gputrace: --max-size {size_text(win['max_size'])} " + "; ".join(parts)


def kept_by_rank(path: str) -> dict[int, tuple[int, int, int, int]]:
    """Per rank: first and last step with detail, how many, and how many steps before the
    first keep only their `run` entry."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from gputrace.window import unpack

    with pa.memory_map(path) as src:
        t = pa.ipc.open_file(src).read_all()
    t = t.filter(pc.is_in(t["cat"].cast(pa.string()), pa.array(["iteration", "run"])))
    rows = t.select(["cat", "name", "rank", "step", "start_ns", "end_ns", "args"]).to_pylist()
    detail: dict[int, list[int]] = {}
    runs: dict[int, list[int]] = {}
    for r in rows:
        if r["name"] != "iteration":
            continue
        rank = r["rank"] if r["rank"] is not None else -1
        if r["cat"] == "iteration":
            detail.setdefault(rank, []).append(r["step"])
        else:
            runs.setdefault(rank, []).extend(
                s for s, *_ in unpack(r["start_ns"], r["end_ns"], r["step"], r["args"]))
    out = {}
    for rank in set(detail) | set(runs):
        d = sorted(detail.get(rank, []))
        first = d[0] if d else None
        earlier = len({s for s in runs.get(rank, []) if first is None or s < first})
        out[rank] = (d[0] if d else -1, d[-1] if d else -1, len(d), earlier)
    return out
