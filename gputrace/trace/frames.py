"""A running process's shard: what its recorder drained, written as the Python values they
are (marshal, version 4) in length-prefixed, checksummed frames. The job builds no Arrow
columns and imports no pyarrow: a flush of a few hundred spans costs ~50 us of its CPU
(an Arrow batch ~0.7 ms, and its caches disturbed after). Whoever reads a shard — the
merge, `recover`, a reader of a recording still running — turns it into the trace
format's table (`read_table`); a frame a killed process left cut short ends what is read.

The file: MAGIC, then frames, each a kind byte, three zero bytes, the payload's length and
CRC-32 (little-endian uint32), the payload.
  M  the shard's metadata, JSON. Written when the file is opened, again when the process
     learns its rank in-process (`rank_from`: the events written before carried rank -1,
     and are read with the rank it learned: a process is one rank for its life), and at
     close with what collectors said during the run: the last one read wins.
  E  events: marshal of (host, rank, pid, perf_offset, spans, perf_spans, rows).
     spans: (cat, name, start_ns, end_ns, tid, step, layer, bytes, args) tuples on the
     trace clock; perf_spans: the same timed with time.perf_counter_ns (perf_offset moves
     them onto the trace clock); rows: whole rows in the trace columns' order (trailing
     extension columns may be left out).
  Z  closed (no payload).
"""

from __future__ import annotations

import json
import marshal
import mmap
import os
import struct
import zlib
from collections.abc import Iterator, Sequence
from itertools import chain
from typing import TYPE_CHECKING, Any

from gputrace.fmt import reason, write_failed

if TYPE_CHECKING:
    import pyarrow as pa

MAGIC = b"GTSPANS1"
SUFFIX = ".spans"
_HEAD = struct.Struct("<c3xII")
_MARSHAL = 4          # marshal's format since Python 3.4, read by every later version
_SPAN_WIDTH = 9
_CHUNK_ROWS = 1 << 16  # rows per record batch when a shard is read
_FRAME_EVENTS = 4096   # events per frame at most (~300 KB)


def _cut(items: list[Any], lo: int, n: int) -> list[Any]:
    """Items lo..lo+n of a list (lo may be negative: the slice starts at 0)."""
    if lo <= 0 and lo + n >= len(items):
        return items
    return items[max(lo, 0):max(lo + n, 0)]


def _frame(kind: bytes, payload: bytes) -> bytes:
    if len(payload) >= 1 << 32:
        raise ValueError(f"{len(payload)} bytes in one batch")
    return _HEAD.pack(kind, len(payload), zlib.crc32(payload)) + payload


_PLAIN = frozenset((str, int, float, bool, type(None)))


def _is_plain(items: list[tuple[Any, ...]]) -> bool:
    """Whether tuples hold only values marshal writes as themselves."""
    return set(map(type, chain.from_iterable(items))) <= _PLAIN


def _plain(value: Any) -> Any:
    """A value marshal can write: numpy scalars and subclasses of str/int/float as the
    Python value they hold, tuples and lists walked (ValueError for anything else)."""
    t = type(value)
    if value is None or t in (str, int, float, bool):
        return value
    if t in (tuple, list):
        return t(map(_plain, value))
    for base in (bool, int, float, str):
        if isinstance(value, base):
            return base(value)
    item = getattr(value, "item", None)   # numpy scalars
    if item is not None:
        return _plain(item())
    raise ValueError(f"a {t.__name__} value cannot be recorded")


class FrameWriter:
    """Appends frames to one shard. Write errors (disk full, a directory that went away)
    turn it off, said once on stderr unless `quiet`; what was written stays readable."""

    def __init__(self, path: str | os.PathLike[str], metadata: dict[str, Any],
                 quiet: bool = False) -> None:
        self.path = os.fspath(path)
        self.quiet = quiet
        self.error: str | None = None
        self.errno = 0
        self.rows_written = 0
        self.written = 0         # bytes written to the file
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC
                                       | os.O_CLOEXEC, 0o644)
        self._put(MAGIC + _frame(b"M", _metadata(metadata)))
        if self.error is not None:
            raise OSError(self.errno, self.error)

    def _put(self, data: bytes) -> None:
        view = memoryview(data)
        try:
            while view and self._fd is not None:
                n = os.write(self._fd, view)
                self.written += n
                view = view[n:]
        except OSError as e:
            self._fail(e)

    def _fail(self, e: BaseException) -> None:
        write_failed(self, e)
        self.abandon()

    def write(self, host: str, rank: int, pid: int, perf_offset: int,
              spans: list[tuple[Any, ...]], perf_spans: list[tuple[Any, ...]],
              rows: list[tuple[Any, ...]]) -> None:
        """Events, in frames of at most _FRAME_EVENTS each (a disk that fills up loses the
        frame it cut short, not the whole flush). ValueError where a value cannot be
        written (not a number or a string): nothing of that frame is."""
        for frame, n in self.encode(host, rank, pid, perf_offset, spans, perf_spans, rows):
            self.put(frame, n)

    def encode(self, host: str, rank: int, pid: int, perf_offset: int,
               spans: list[tuple[Any, ...]], perf_spans: list[tuple[Any, ...]],
               rows: list[tuple[Any, ...]]) -> Iterator[tuple[bytes, int]]:
        """The frames `write` writes, each with its number of events (made as they are
        taken: none once the writer is off)."""
        n = len(spans) + len(perf_spans) + len(rows)
        for lo in range(0, n, _FRAME_EVENTS):
            if self._fd is None:
                return
            part = [_cut(x, lo - a, _FRAME_EVENTS) for x, a in
                    ((spans, 0), (perf_spans, len(spans)), (rows, len(spans) + len(perf_spans)))]
            # marshal would write a numpy value as its raw bytes: the spans and rows of
            # collectors and the job's calls are made plain where they hold one (the hot
            # hooks' perf_spans are the recorder's own ints and strings)
            sp, perf, rw = part
            sp = sp if _is_plain(sp) else _plain(sp)
            rw = rw if _is_plain(rw) else _plain(rw)
            body = marshal.dumps((host, rank, pid, perf_offset, sp, perf, rw), _MARSHAL)
            yield _frame(b"E", body), sum(map(len, part))

    def put(self, frame: bytes, events: int) -> None:
        """One frame of `encode`'s."""
        self._put(frame)
        if self._fd is not None:
            self.rows_written += events

    def put_metadata(self, metadata: dict[str, Any]) -> None:
        """The metadata as it is now (a rank learned during the run): the last one wins."""
        if self._fd is not None:
            self._put(_frame(b"M", _metadata(metadata)))

    def close(self, metadata: dict[str, Any] | None = None) -> None:
        """Close, writing the metadata again (as it is now) and the closing frame."""
        if self._fd is None:
            return
        self._put((_frame(b"M", _metadata(metadata)) if metadata is not None else b"")
                  + _frame(b"Z", b""))
        self.abandon()

    def abandon(self) -> None:
        """Let go of the file as it is (a forked child, of its parent's shard)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass


def _metadata(md: dict[str, Any]) -> bytes:
    return json.dumps(md, default=str, separators=(",", ":")).encode()


def is_frames(head: bytes) -> bool:
    return head.startswith(MAGIC)


class Frames:
    """The frames of one shard, read in order up to the first that is cut short or damaged."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.size = os.path.getsize(path)
        self.metadata: dict[str, Any] | None = None
        self.closed = False      # its closing frame was read
        self.damaged = 0         # events frames read but unreadable
        self.read = 0            # events frames read

    def events(self) -> Iterator[tuple[Any, ...]]:
        """Each events frame's tuple, checked for its shape; metadata frames read on the
        way (`metadata` is the last one's)."""
        with open(self.path, "rb") as f:
            if not self.size:
                return
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                yield from self._walk(memoryview(buf))

    def _walk(self, view: memoryview) -> Iterator[tuple[Any, ...]]:
        try:
            pos = len(MAGIC)
            while pos + _HEAD.size <= len(view):
                kind, n, crc = _HEAD.unpack_from(view, pos)
                body = view[pos + _HEAD.size:pos + _HEAD.size + n]
                if len(body) < n or zlib.crc32(body) != crc:
                    return   # cut short where the process was killed, or damaged after
                pos += _HEAD.size + n
                if kind == b"M":
                    md = json.loads(bytes(body))
                    if isinstance(md, dict):
                        self.metadata = md
                elif kind == b"Z":
                    self.closed = True
                    return
                elif kind == b"E":
                    self.read += 1
                    ev = _events(body)
                    if ev is None:
                        self.damaged += 1
                    else:
                        yield ev
                else:
                    return
        finally:
            view.release()


def _events(body: memoryview) -> tuple[Any, ...] | None:
    try:
        ev = marshal.loads(body)
    except (ValueError, EOFError, TypeError):
        return None
    if not (isinstance(ev, tuple) and len(ev) == 7 and isinstance(ev[3], int)
            and all(isinstance(x, list) for x in ev[4:])):
        return None
    return ev


_RANK = 8   # the rank's column (kind cat name start_ns end_ns value unit host rank ...)


def _columns(ev: tuple[Any, ...], width: int, ranks_only: bool = False
             ) -> list[Sequence[Any]]:
    """One events frame as `width` columns in the trace's order (ValueError where its
    tuples are not the shape they should be). `ranks_only`: the others left empty."""
    from gputrace.trace.writer import row_columns

    host, rank, pid, offset, spans, perf, rows = ev
    if ranks_only:   # which ranks a shard holds (the merge's index of shards)
        col = (rank,) * (len(spans) + len(perf)) + tuple(
            r[_RANK] if len(r) > _RANK else None for r in rows)
        return [()] * _RANK + [col] + [()] * (width - _RANK - 1)
    n = len(spans) + len(perf)
    c, nm, s, e, tid, st, ly, b, a = zip(*spans, *perf, strict=True) if n else \
        ((),) * _SPAN_WIDTH
    if perf:   # onto the trace clock
        k = len(spans)
        s = (*s[:k], *[x + offset for x in s[k:]])
        e = (*e[:k], *[x + offset for x in e[k:]])
    none = (None,) * n
    cols: list[Sequence[Any]] = [
        ("span",) * n, c, nm, s, e, none, none, (host,) * n, (rank,) * n, (pid,) * n, tid,
        (-1,) * n, (-1,) * n, st, ly, b, none, none, none, a]
    cols += [none] * (width - len(cols))
    if rows:
        if any(not isinstance(r, tuple | list) or len(r) > width for r in rows):
            raise ValueError("a row of the wrong shape")
        cols = [(*x, *y) for x, y in zip(cols, row_columns(rows), strict=True)]
    return cols


def read_table(path: str, only: Sequence[str] | None = None
               ) -> tuple[pa.Table, dict[str, Any], str | None]:
    """A shard as the trace's table (`only`: just those columns), its metadata, and a
    warning where it was not closed or is damaged. TraceFormatError where nothing in it
    can be read (killed before its metadata was written)."""
    import pyarrow as pa

    from gputrace.trace.schema import COLUMNS, FORMAT, VERSION, TraceFormatError, conform

    fr = Frames(path)
    want = [i for i, (name, *_) in enumerate(COLUMNS) if only is None or name in only]
    batches: list[pa.RecordBatch] = []
    pending: list[list[Sequence[Any]]] = []

    def convert() -> None:
        batch = _batch([_joined(pending, i) for i in want], want)
        if batch is None:   # a frame holds a value of the wrong type: find it, keep the rest
            for one in pending:
                b = _batch([one[i] for i in want], want)
                if b is None:
                    fr.damaged += 1
                else:
                    batches.append(b)
        else:
            batches.append(batch)
        pending.clear()

    try:
        for ev in fr.events():
            try:
                pending.append(_columns(ev, len(COLUMNS), want == [_RANK]))
            except (ValueError, TypeError):
                fr.damaged += 1
                continue
            if sum(len(p[0]) for p in pending) >= _CHUNK_ROWS:
                convert()
    except (OSError, ValueError) as e:
        if fr.metadata is None:
            raise TraceFormatError(f"cannot read {path}: {reason(e)}") from None
    if pending:
        convert()
    if fr.metadata is None:
        raise TraceFormatError(f"{path} is truncated before its metadata; nothing to recover")
    md = dict(fr.metadata, format=FORMAT, version=VERSION)
    sch = pa.schema([pa.field(COLUMNS[i][0], COLUMNS[i][1]) for i in want])
    table = _learned_rank(conform(pa.Table.from_batches(batches, schema=sch), only), md)
    warning = None
    if not fr.closed:
        warning = (f"{path} was not closed (killed run?) or is damaged: recovered "
                   f"{fr.read - fr.damaged} complete batches, {table.num_rows} rows, of "
                   f"{fr.size} bytes")
    elif fr.damaged:
        warning = (f"{path}: {fr.damaged} of its {fr.read} batches held values the trace "
                   f"cannot (left out); {table.num_rows} rows read")
    return table, md, warning


def _learned_rank(table: pa.Table, md: dict[str, Any]) -> pa.Table:
    """A process that learned its rank during the run (torch.distributed, see
    Recorder.learn_rank): its events from before, written with rank -1, get that rank."""
    rank = md.get("rank")
    if not md.get("rank_from") or not isinstance(rank, int) or rank < 0 or \
            "rank" not in table.column_names:
        return table
    import pyarrow as pa
    import pyarrow.compute as pc

    col = table.column("rank")
    fixed = pc.if_else(pc.equal(col, -1), pa.scalar(rank, col.type), col)
    return table.set_column(table.column_names.index("rank"), "rank", fixed)


def _joined(parts: list[list[Sequence[Any]]], i: int) -> Sequence[Any]:
    if len(parts) == 1:
        return parts[0][i]
    out: list[Any] = []
    for p in parts:
        out.extend(p[i])
    return out


def _batch(cols: list[Sequence[Any]], at: list[int]) -> pa.RecordBatch | None:
    """Columns (those of the trace at `at`) as a record batch; None where a value is not of
    its column's type."""
    import pyarrow as pa

    from gputrace.trace.writer import column_arrays

    try:
        arrays = column_arrays(cols, at)
    except (TypeError, ValueError, OverflowError, pa.ArrowException):
        return None
    from gputrace.trace.schema import COLUMNS

    return pa.RecordBatch.from_arrays(arrays, names=[COLUMNS[i][0] for i in at])
