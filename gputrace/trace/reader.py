"""Load traces: one file, several shards or a directory of shards; recover truncated files."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from gputrace.trace import frames
from gputrace.trace.arrays import scalar
from gputrace.trace.schema import (
    TraceFormatError,
    conform,
    read_metadata,
)

MAGIC = b"ARROW1"
# what a directory of shards holds: trace files, and running processes' shards (frames)
SHARD_SUFFIXES = (".arrow", frames.SUFFIX)

# how the files of one run are found from its name (re-exported: callers import them here)
from gputrace.trace.parts import expand_names, node_files  # noqa: E402

__all__ = ["expand_names", "node_files"]


@dataclass
class Trace:
    table: pa.Table
    metadata: dict[str, Any]
    sources: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def num_rows(self) -> int:
        return self.table.num_rows


@dataclass
class _Part:
    table: pa.Table
    metadata: dict[str, Any]
    warning: str | None


def _read_one(path: str, only: Sequence[str] | None = None) -> _Part:
    """One file as a table (`only`: just those v1 columns, the others' buffers unread)."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
    except OSError as e:
        raise TraceFormatError(f"cannot read {path}: {e.strerror or e}") from None
    if frames.is_frames(head):   # a running (or killed) process's shard
        return _Part(*frames.read_table(path, only))
    if not head.startswith(MAGIC):
        raise TraceFormatError(f"{path} is not an Arrow IPC file (bad magic)")
    try:
        buf = pa.memory_map(path).read_buffer()
    except (OSError, pa.ArrowException) as e:
        raise TraceFormatError(f"cannot read {path}: {e}") from None

    def options(schema: pa.Schema) -> pa.ipc.IpcReadOptions | None:
        at = [i for i, f in enumerate(schema) if f.name in only] if only is not None else []
        # none of them in the file: read it whole, which gives the row count their defaults need
        return pa.ipc.IpcReadOptions(included_fields=at) if at else None

    try:
        rd = pa.ipc.open_file(buf)
        md = read_metadata(rd.schema)
        if only is not None:
            rd = pa.ipc.open_file(buf, options=options(rd.schema))
        table = rd.read_all()
        table.validate(full=True)   # offsets, dictionary indices, UTF-8
        return _Part(conform(table, only), md, None)
    except TraceFormatError:
        raise
    except (pa.ArrowException, OSError, ValueError):
        pass
    # Truncated (a killed run): the body after the 8-byte magic is an IPC stream.
    batches: list[pa.RecordBatch] = []
    try:
        stream = pa.ipc.open_stream(buf.slice(8))
        md = read_metadata(stream.schema)
        if only is not None:
            stream = pa.ipc.open_stream(buf.slice(8), options=options(stream.schema))
    except (pa.ArrowException, OSError, ValueError) as e:
        raise TraceFormatError(f"{path} is truncated before its schema; nothing to recover "
                               f"({e})") from None
    try:
        for b in stream:
            b.validate(full=True)   # a corrupt batch ends what can be recovered
            batches.append(b)
    except (pa.ArrowException, OSError, ValueError):
        pass
    table = pa.Table.from_batches(batches, schema=stream.schema)
    warning = (f"{path} was not closed (killed run?) or is damaged: recovered {len(batches)} complete "
               f"batches, {table.num_rows} rows, of {size} bytes")
    return _Part(conform(table, only), md, warning)


@dataclass
class Unclosed:
    """A recording of `path` that never became that file: killed before it merged its shards
    (or still running), its shards in `directory`."""

    path: str
    directory: str
    live: bool
    others: list[str]        # older unfinished recordings of the same path

    def note(self, shards_read: int, cut_short: int, skipped: int) -> str:
        if self.live:
            text = (f"{self.path} is still being recorded: read what {shards_read} shard"
                    f"{'s' if shards_read != 1 else ''} in {self.directory} hold so far")
        else:
            text = (f"{self.path} was not closed (the recording was killed?): read "
                    f"{shards_read} shard{'s' if shards_read != 1 else ''} from "
                    f"{self.directory}")
            if cut_short:
                text += f", {cut_short} cut short and recovered to their last complete batch"
            if skipped:
                text += f", {skipped} with nothing readable left out"
            text += f"; `gputrace recover {self.path}` writes {self.path}"
        if self.others:
            text += (f" ({len(self.others)} older unfinished recording"
                     f"{'s' if len(self.others) != 1 else ''} of it beside it)")
        return text


def unclosed(path: str | os.PathLike[str]) -> Unclosed | None:
    """Where the shards of a trace path that does not exist are, when a recording of it was
    killed before it could merge them (or is still running); None when there are none."""
    from gputrace.trace import shards

    path = os.fspath(path)
    if os.path.exists(path):
        return None
    found = shards.find(path)
    if not found:
        return None
    return Unclosed(path, found[0], shards.in_use(found[0]), found[1:])


def _newer_unclosed(path: str) -> str | None:
    """A warning when a recording of an existing trace file was killed after it."""
    from gputrace.trace import shards

    try:
        mtime = os.stat(path).st_mtime
    except OSError:
        return None
    newer = [d for d in shards.find(path)
             if os.stat(d).st_mtime > mtime and not shards.in_use(d)]
    if not newer:
        return None
    return (f"a later recording of {path} was not closed: its shards are in {newer[0]} "
            f"(`gputrace recover -f {path}` replaces {path} with it)")


def _expand(paths: Iterable[str | os.PathLike[str]]
            ) -> tuple[list[tuple[str, Unclosed | None]], list[str]]:
    """The files to read, each with the unclosed recording it belongs to (when a path named
    a trace that was never written), and warnings about the paths."""
    out: list[tuple[str, Unclosed | None]] = []
    notes: list[str] = []
    for p in expand_names(paths):
        run = None
        if not os.path.exists(p):
            run = unclosed(p)
            if run is None:
                raise TraceFormatError(f"{p}: no such file or directory")
            d = run.directory
        else:
            d = p
        if os.path.isdir(d):
            try:
                names = os.listdir(d)
            except OSError as e:
                raise TraceFormatError(f"cannot read {d}: {e.strerror or e}") from None
            found = sorted(os.path.join(d, n) for n in names
                           if n.endswith(SHARD_SUFFIXES) and os.path.isfile(os.path.join(d, n)))
            if not found:
                if run is not None:
                    raise TraceFormatError(f"{p}: the recording stopped before it wrote "
                                           f"anything ({d} holds no shards)")
                raise TraceFormatError(f"{p} holds no shards (.arrow, {frames.SUFFIX})")
            out.extend((f, run) for f in found)
        else:
            out.append((p, None))
            late = _newer_unclosed(p)
            if late:
                notes.append(late)
    if not out:
        raise TraceFormatError("no trace given")
    return out, notes


def _read_all(paths: Sequence[str | os.PathLike[str]], skip_unreadable: bool,
              only: Sequence[str] | None = None,
              keep: Callable[[_Part], _Part] | None = None
              ) -> tuple[list[str], list[_Part], list[str]]:
    """The files (of paths, directories expanded) that could be read, what was read of each
    (`keep`: what to keep of it, so that a caller holds one file's rows at a time), and the
    warnings. The shards of an unclosed recording are read as a merge reads them
    (unreadable ones left out) and said in one warning."""
    files, notes = _expand(paths)
    parts, read, warnings = [], [], list(notes)
    runs: dict[str, list[int]] = {}   # unclosed path -> [shards read, cut short, skipped]
    for f, run in files:
        counts = runs.setdefault(run.path, [0, 0, 0]) if run is not None else None
        try:
            part = _read_one(f, only)
        except TraceFormatError as e:
            if counts is not None:
                counts[2] += 1
                continue
            if not skip_unreadable:
                raise
            warnings.append(f"{os.path.basename(f)}: skipped, nothing readable in it ({e})")
            continue
        read.append(f)
        if counts is not None:
            counts[0] += 1
            counts[1] += part.warning is not None
        elif part.warning:
            warnings.append(part.warning)
        parts.append(keep(part) if keep else part)
    for run in {r.path: r for _, r in files if r is not None}.values():
        warnings.insert(0, run.note(*runs[run.path]))
    if not parts:
        raise TraceFormatError(f"nothing readable in {' '.join(map(str, paths))}")
    return read, parts, warnings


def load(*paths: str | os.PathLike[str], skip_unreadable: bool = False) -> Trace:
    """Load one trace file, several shards, or a directory of shards, as one table.

    Truncated files are recovered up to their last complete batch, with a warning.
    Raises TraceFormatError for anything that is not a readable gputrace trace; with
    `skip_unreadable` (merging a run's shards), a file with nothing readable in it — a
    process killed while writing its header — is left out with a warning instead.
    """
    files, parts, warnings = _read_all(paths, skip_unreadable)
    if len(parts) == 1:
        table, md = parts[0].table, parts[0].metadata
    else:
        table = pa.concat_tables([p.table for p in parts], promote_options="permissive")
        md = merge_metadata([p.metadata for p in parts])
    if not all(os.path.exists(p) for p in paths):   # read from an unclosed recording's shards
        md = dict(md, unclosed=True)
    return Trace(table, md, files, warnings)


@dataclass
class Shard:
    path: str
    metadata: dict[str, Any]
    ranks: set[int]          # the ranks its rows hold

    def read(self, rank: int) -> pa.Table:
        """Its rows of one rank (recovered as far as they can be, as `load` does)."""
        table = _read_one(self.path).table
        if self.ranks != {rank}:
            ranks = _ranks(table)
            table = table.filter(pc.equal(ranks, scalar(rank, ranks.type)))
        return table


def _ranks(table: pa.Table) -> pa.ChunkedArray:
    col = table.column("rank")
    return pc.fill_null(col, scalar(-1, col.type))   # no rank given: the v1 default


def index_shards(path: str | os.PathLike[str]) -> tuple[list[Shard], list[str]]:
    """The readable shards in a directory, each with the ranks its rows hold (only their
    rank columns are read), and the warnings `load(path, skip_unreadable=True)` gives."""
    def ranks_only(p: _Part) -> _Part:   # the rank column of every shard would add up
        return _Part(pa.table({"rank": _ranks(p.table).unique()}), p.metadata, p.warning)

    files, parts, warnings = _read_all([path], True, only=("rank",), keep=ranks_only)
    return [Shard(f, p.metadata, set(p.table.column("rank").to_pylist()))
            for f, p in zip(files, parts, strict=True)], warnings


def collector_weight(info: Any) -> int:
    """Which collector status wins in a merge: ran and broke (a process says what it lost) >
    ran (ok) > tried and could not start > a guess."""
    if not isinstance(info, dict):
        return -1
    status = str(info.get("status", ""))
    if status.startswith(("failed", "stopped")):
        return 3
    return 2 if status.startswith("ok") else 1 if status.startswith("unavailable") else 0


def merge_metadata(shards: list[dict[str, Any]]) -> dict[str, Any]:
    """Top-level metadata of a merged trace; each shard's own stays under `shards`."""
    flat: list[dict[str, Any]] = []
    for md in shards:
        inner = md.get("shards")
        if isinstance(inner, list) and inner:
            flat.extend(x for x in inner if isinstance(x, dict))
        else:
            flat.append(md)
    primary = next((m for m in flat if m.get("role") == "record"), flat[0] if flat else {})
    out = {k: v for k, v in primary.items() if k != "shards"}
    ranks = sorted({m.get("rank") for m in flat if isinstance(m.get("rank"), int)
                    and m.get("rank", -1) >= 0})
    hosts = sorted({m.get("host") for m in flat if isinstance(m.get("host"), str)})
    starts = [m["start"]["realtime_ns"] for m in flat
              if isinstance(m.get("start"), dict) and "realtime_ns" in m["start"]]
    ends = [m["end"]["realtime_ns"] for m in flat
            if isinstance(m.get("end"), dict) and "realtime_ns" in m["end"]]
    out["ranks"] = ranks
    out["hosts"] = hosts
    # the processes' own view where the launcher said nothing (a rank learned in-process)
    worlds = [m["world_size"] for m in flat if isinstance(m.get("world_size"), int)]
    if worlds and max(worlds) > (out.get("world_size") if isinstance(out.get("world_size"), int)
                                 else -1):
        out["world_size"] = max(worlds)
    if starts:
        out.setdefault("start", {})["realtime_ns"] = min(starts)
    if ends:
        out.setdefault("end", {})["realtime_ns"] = max(ends)
    collectors: dict[str, Any] = dict(out.get("collectors") or {})
    for m in flat:
        for name, info in (m.get("collectors") or {}).items():
            if collector_weight(info) > collector_weight(collectors.get(name)):
                collectors[name] = info
    out["collectors"] = collectors
    out["shards"] = flat
    return out
