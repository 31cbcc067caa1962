"""Trace files read rank by rank: where each rank's record batches are, and its columns read
together, so an analysis holds one rank's rows at once, not the whole run's."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from gputrace.trace.reader import MAGIC, SHARD_SUFFIXES, merge_metadata
from gputrace.trace.schema import COLUMN_NAMES, DEFAULTS, TraceFormatError, conform, read_metadata


class RankUnreadable(TraceFormatError):
    """A RankedTrace's batches of one rank cannot be read; `load` recovers what it can."""


@dataclass(frozen=True)
class RankSource:
    """Where one rank's rows are: (file, its record batches) pairs. Plain data, so a worker
    process, or a worker on another machine that sees the same files, reads the rank itself
    (`read_rank`)."""

    rank: int
    parts: tuple[tuple[str, tuple[int, ...]], ...]
    rows: int


class RankedTrace:
    """Intact trace files whose record batches each hold a single rank (as `record` and
    `import` write them; one file per node of a multi-node run): its ranks are read one at a
    time, so a consumer holds one rank's rows at once, not the whole run's. A rank may have
    rows in several files (the samples of each node's recording process are rank -1)."""

    def __init__(self, paths: list[str], metadata: dict[str, Any],
                 groups: dict[int, list[tuple[int, list[int]]]], rows: dict[int, int],
                 schemas: list[pa.Schema]) -> None:
        self.metadata = metadata
        self.sources = list(paths)
        self.warnings: list[str] = []
        self.groups = groups          # rank -> [(file index, its record batches)]
        self.rows = rows              # rank -> its rows
        self._fields = [{f.name: i for i, f in enumerate(sch)} for sch in schemas]
        self._files: dict[int, pa.NativeFile] = {}
        self._readers: dict[tuple[int, tuple[int, ...]], pa.ipc.RecordBatchFileReader] = {}

    @property
    def ranks(self) -> list[int]:
        return sorted(self.groups)

    def source(self, rank: int) -> RankSource:
        return RankSource(rank, tuple((self.sources[f], tuple(b)) for f, b in self.groups[rank]),
                          self.rows[rank])

    def columns(self, rank: int, only: Sequence[str] | None = None) -> RankColumns:
        """One rank's columns (every v1 column, or those in `only`), each read from the
        file only when it is asked for."""
        return RankColumns(self, rank, COLUMN_NAMES if only is None else only)

    def _reader(self, f: int, at: tuple[int, ...]) -> pa.ipc.RecordBatchFileReader:
        rd = self._readers.get((f, at))
        if rd is None:
            src = self._files.get(f)
            if src is None:
                # read, not mapped: a mapped file's pages would stay in the process as each
                # rank is read, and count in its memory
                src = self._files[f] = pa.OSFile(self.sources[f])
            opts = pa.ipc.IpcReadOptions(included_fields=list(at))
            rd = self._readers[(f, at)] = pa.ipc.open_file(src, options=opts)
        return rd

    def read_columns(self, rank: int, names: Sequence[str]) -> dict[str, pa.ChunkedArray]:
        """Some columns of one rank's batches: only their buffers are read and
        decompressed; a v1 column a file lacks takes its default."""
        tables = []
        try:
            for f, batches in self.groups[rank]:
                fields = self._fields[f]
                at = tuple(sorted(fields[n] for n in names if n in fields))
                if at:
                    rd = self._reader(f, at)
                    table = pa.Table.from_batches([rd.get_batch(i) for i in batches],
                                                  schema=rd.schema)
                    table.validate(full=True)
                else:   # only columns the file lacks: the row count is all they need
                    n = sum(self._reader(f, (0,)).get_batch(i).num_rows for i in batches)
                    table = pa.table({"_": pa.nulls(n)})
                tables.append(conform(table, names))
            table = tables[0] if len(tables) == 1 else \
                pa.concat_tables(tables, promote_options="permissive")
        except (pa.ArrowException, OSError, ValueError) as e:
            raise RankUnreadable(f"{self.sources[self.groups[rank][0][0]]}: rank {rank} is "
                                 f"damaged ({e})") from None
        return {n: table.column(n) for n in names}

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()
        self._readers.clear()


def read_rank(source: RankSource, names: Sequence[str]) -> RankColumns:
    """The columns of one rank, read from its files as they are asked for (a worker's side
    of `RankedTrace.source`)."""
    paths = sorted({p for p, _ in source.parts})
    schemas = []
    for p in paths:
        try:
            with pa.OSFile(p) as f:
                schemas.append(pa.ipc.open_file(f).schema)
        except (pa.ArrowException, OSError, ValueError) as e:
            raise RankUnreadable(f"{p}: cannot read rank {source.rank} ({e})") from None
    groups = {source.rank: [(paths.index(p), list(b)) for p, b in source.parts]}
    trace = RankedTrace(paths, {}, groups, {source.rank: source.rows}, schemas)
    return trace.columns(source.rank, names)


class RankColumns:
    """One rank's columns, read from the file together at the first pop (a rank of 1e5
    events is ~10 MB of Arrow buffers; read two at a time, the reads' own cost doubled the
    reading: bench/README.md), each handed over as it is popped, so a consumer that converts
    each in turn frees its Arrow buffers as it goes."""

    def __init__(self, trace: RankedTrace, rank: int, names: Sequence[str]) -> None:
        self._trace, self._rank = trace, rank
        self._names = [n for n in names if n in DEFAULTS]
        self._read: dict[str, pa.ChunkedArray] = {}

    def __contains__(self, name: object) -> bool:
        return name in self._names

    def __len__(self) -> int:
        return len(self._names)

    def pop(self, name: str) -> pa.ChunkedArray:
        if name not in self._names:
            raise KeyError(name)
        if name not in self._read:
            self._read.update(self._trace.read_columns(
                self._rank, [n for n in self._names if n not in self._read]))
        self._names.remove(name)
        return self._read.pop(name)

    def clear(self) -> None:
        self._names.clear()
        self._read.clear()


def _rank_groups(path: str) -> tuple[dict[str, Any], pa.Schema, dict[int, list[int]],
                                     dict[int, int]] | None:
    """A file's metadata, schema, and record batches and rows per rank; None when it cannot
    be read rank by rank (not a trace, truncated, or batches that mix ranks)."""
    if not os.path.isfile(path):
        return None
    try:
        with open(path, "rb") as f:
            if not f.read(8).startswith(MAGIC):
                return None
        with pa.OSFile(path) as buf:
            rd = pa.ipc.open_file(buf)
            md = read_metadata(rd.schema)
            at = rd.schema.get_field_index("rank")
            if at < 0:
                return None
            only = pa.ipc.open_file(buf, options=pa.ipc.IpcReadOptions(included_fields=[at]))
            groups: dict[int, list[int]] = {}
            rows: dict[int, int] = {}
            for i in range(only.num_record_batches):
                col = only.get_batch(i).column(0)
                if col.null_count:
                    return None
                lo, hi = (v.as_py() for v in pc.min_max(col).values())
                if lo != hi:
                    return None
                if lo is not None:
                    groups.setdefault(lo, []).append(i)
                    rows[lo] = rows.get(lo, 0) + len(col)
            return md, rd.schema, groups, rows
    except (TraceFormatError, pa.ArrowException, OSError, ValueError):
        return None


def open_ranked(paths: Sequence[str | os.PathLike[str]]) -> RankedTrace | None:
    """The files as one RankedTrace, or None when one of them cannot be read rank by rank
    (a directory, a truncated file, or batches that mix ranks: `load` reads those whole)."""
    paths = [os.fspath(p) for p in paths]
    found = [_rank_groups(p) for p in paths]
    if not found or any(f is None for f in found):
        return None
    groups: dict[int, list[tuple[int, list[int]]]] = {}
    rows: dict[int, int] = {}
    for i, (_, _, g, n) in enumerate(found):   # type: ignore[misc]
        for r, batches in g.items():
            groups.setdefault(r, []).append((i, batches))
            rows[r] = rows.get(r, 0) + n[r]
    mds = [f[0] for f in found]   # type: ignore[index]
    md = mds[0] if len(mds) == 1 else merge_metadata(mds)
    return RankedTrace(paths, md, groups, rows, [f[1] for f in found])  # type: ignore[index]


def open_by_rank(path: str | os.PathLike[str]) -> RankedTrace | None:
    """One file as a RankedTrace (see `open_ranked`)."""
    return open_ranked([path])


def ranked_files(paths: Sequence[str]) -> list[str] | None:
    """The files a rank-by-rank reading of `paths` would read (a directory: its shards), or None where a path is not there (an unclosed recording: `load` reads it)."""
    out: list[str] = []
    for p in paths:
        if os.path.isdir(p):
            try:
                names = sorted(os.listdir(p))
            except OSError:
                return None
            out.extend(os.path.join(p, n) for n in names
                       if n.endswith(SHARD_SUFFIXES) and os.path.isfile(os.path.join(p, n)))
        elif os.path.isfile(p):
            out.append(p)
        else:
            return None
    return out or None
