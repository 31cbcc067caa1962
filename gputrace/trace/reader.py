"""Load traces: one file, several shards or a directory of shards; recover truncated files."""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from gputrace.trace.schema import TraceFormatError, conform, read_metadata

MAGIC = b"ARROW1"


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


def _read_one(path: str) -> _Part:
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
    except OSError as e:
        raise TraceFormatError(f"cannot read {path}: {e.strerror or e}") from None
    if not head.startswith(MAGIC):
        raise TraceFormatError(f"{path} is not an Arrow IPC file (bad magic)")
    try:
        buf = pa.memory_map(path).read_buffer()
    except (OSError, pa.ArrowException) as e:
        raise TraceFormatError(f"cannot read {path}: {e}") from None
    try:
        rd = pa.ipc.open_file(buf)
        md = read_metadata(rd.schema)
        table = rd.read_all()
        table.validate(full=True)   # offsets, dictionary indices, UTF-8
        return _Part(conform(table), md, None)
    except TraceFormatError:
        raise
    except (pa.ArrowException, OSError, ValueError):
        pass
    # Truncated (a killed run): the body after the 8-byte magic is an IPC stream.
    batches: list[pa.RecordBatch] = []
    try:
        stream = pa.ipc.open_stream(buf.slice(8))
    except (pa.ArrowException, OSError, ValueError) as e:
        raise TraceFormatError(f"{path} is truncated before its schema; nothing to recover "
                               f"({e})") from None
    md = read_metadata(stream.schema)
    try:
        for b in stream:
            b.validate(full=True)   # a corrupt batch ends what can be recovered
            batches.append(b)
    except (pa.ArrowException, OSError, ValueError):
        pass
    table = pa.Table.from_batches(batches, schema=stream.schema)
    warning = (f"{path} was not closed (killed run?) or is damaged: recovered {len(batches)} complete "
               f"batches, {table.num_rows} rows, of {size} bytes")
    return _Part(conform(table), md, warning)


def _expand(paths: Iterable[str | os.PathLike[str]]) -> list[str]:
    out: list[str] = []
    for p in paths:
        p = os.fspath(p)
        if os.path.isdir(p):
            found = sorted(
                os.path.join(p, n) for n in os.listdir(p)
                if n.endswith(".arrow") and os.path.isfile(os.path.join(p, n))
            )
            if not found:
                raise TraceFormatError(f"{p} holds no .arrow shards")
            out.extend(found)
        elif os.path.exists(p):
            out.append(p)
        else:
            raise TraceFormatError(f"{p}: no such file or directory")
    if not out:
        raise TraceFormatError("no trace given")
    return out


def load(*paths: str | os.PathLike[str], skip_unreadable: bool = False) -> Trace:
    """Load one trace file, several shards, or a directory of shards, as one table.

    Truncated files are recovered up to their last complete batch, with a warning.
    Raises TraceFormatError for anything that is not a readable gputrace trace; with
    `skip_unreadable` (merging a run's shards), a file with nothing readable in it — a
    process killed while writing its header — is left out with a warning instead.
    """
    files = _expand(paths)
    parts, read, skipped = [], [], []
    for f in files:
        try:
            parts.append(_read_one(f))
            read.append(f)
        except TraceFormatError as e:
            if not skip_unreadable:
                raise
            skipped.append(f"{os.path.basename(f)}: skipped, nothing readable in it ({e})")
    if not parts:
        raise TraceFormatError(f"nothing readable in {' '.join(map(str, paths))}")
    files = read
    warnings = [p.warning for p in parts if p.warning] + skipped
    if len(parts) == 1:
        return Trace(parts[0].table, parts[0].metadata, files, warnings)
    tables = [p.table for p in parts]
    table = pa.concat_tables(tables, promote_options="permissive")
    md = merge_metadata([p.metadata for p in parts])
    return Trace(table, md, files, warnings)


class RankUnreadable(TraceFormatError):
    """A RankedTrace's batches of one rank cannot be read; `load` recovers what it can."""


class RankedTrace:
    """One intact trace file whose record batches each hold a single rank (as `record` and
    `import` write them): its ranks are read one at a time, so a consumer holds one rank's
    rows at once, not the whole run's."""

    def __init__(self, path: str, reader: pa.ipc.RecordBatchFileReader,
                 metadata: dict[str, Any], groups: dict[int, list[int]]) -> None:
        self.metadata = metadata
        self.sources = [path]
        self.warnings: list[str] = []
        self.groups = groups          # rank -> its record batches
        self._reader = reader

    @property
    def ranks(self) -> list[int]:
        return sorted(self.groups)

    def columns(self, rank: int) -> dict[str, pa.ChunkedArray]:
        """One rank's rows as columns (a dict the caller may empty as it converts them)."""
        rd = self._reader
        try:
            table = pa.Table.from_batches([rd.get_batch(i) for i in self.groups[rank]],
                                          schema=rd.schema)
            table.validate(full=True)
            table = conform(table)
        except (pa.ArrowException, OSError, ValueError) as e:
            raise RankUnreadable(f"{self.sources[0]}: rank {rank} is damaged ({e})") from None
        return {c: table.column(c) for c in table.column_names}


def open_by_rank(path: str | os.PathLike[str]) -> RankedTrace | None:
    """The file as a RankedTrace, or None when it cannot be read rank by rank (a directory,
    a truncated file, or batches that mix ranks: `load` reads those whole)."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, "rb") as f:
            if not f.read(8).startswith(MAGIC):
                return None
        buf = pa.memory_map(path).read_buffer()
        rd = pa.ipc.open_file(buf)
        md = read_metadata(rd.schema)
        at = rd.schema.get_field_index("rank")
        if at < 0:
            return None
        only = pa.ipc.open_file(buf, options=pa.ipc.IpcReadOptions(included_fields=[at]))
        groups: dict[int, list[int]] = {}
        for i in range(only.num_record_batches):
            col = only.get_batch(i).column(0)
            if col.null_count:
                return None
            lo, hi = pc.min_max(col).values()
            if lo.as_py() != hi.as_py():
                return None
            if lo.as_py() is not None:
                groups.setdefault(int(lo.as_py()), []).append(i)
    except (TraceFormatError, pa.ArrowException, OSError, ValueError):
        return None
    return RankedTrace(path, rd, md, groups)


def collector_weight(info: Any) -> int:
    """Which collector status wins in a merge: ran (ok) > tried and failed > a guess."""
    if not isinstance(info, dict):
        return -1
    status = str(info.get("status", ""))
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
