"""Streaming trace writer: one Arrow IPC file, a record batch per flush."""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from gputrace.fmt import write_failed
from gputrace.trace import arrays
from gputrace.trace.schema import COLUMNS, DICT_COLUMNS, schema

Row = tuple[Any, ...]  # values in schema.COLUMN_NAMES order; trailing extensions optional

_COMPRESSION = "zstd" if pa.Codec.is_available("zstd") else "lz4"


class _DictEncoder:
    """Keeps one growing dictionary per column so every batch only adds a delta."""

    __slots__ = ("index", "values", "_arr")

    def __init__(self) -> None:
        # Seeded: pyarrow treats an empty first dictionary growing later as a replacement,
        # which the IPC file format forbids. None is no value: its code (-1) is a null.
        self.index: dict[str | None, int] = {"": 0, None: -1}
        self.values: list[str] = [""]
        self._arr = arrays.strings(self.values)

    def _code(self, v: str | None) -> int:
        i = self.index.get(v)
        if i is None:
            i = self.index[v] = len(self.values)
            self.values.append(v)  # type: ignore[arg-type]
        return i

    def _dictionary(self) -> pa.Array:
        if len(self._arr) < len(self.values):
            self._arr = pa.concat_arrays(
                [self._arr, arrays.strings(self.values[len(self._arr):])])
        return self._arr

    def _array(self, codes: np.ndarray) -> pa.DictionaryArray:
        isnull = codes < 0
        out = arrays.indices(np.where(isnull, 0, codes), isnull) if isnull.any() \
            else arrays.indices(codes)
        return pa.DictionaryArray.from_arrays(out, self._dictionary())

    def encode(self, col: Sequence[str | None]) -> pa.DictionaryArray:
        """Encode Python strings (None: null); codes are given in order of first appearance,
        as `encode_arrow` gives them. Known values are looked up at C speed."""
        if col and col.count(col[0]) == len(col):   # one value throughout (a span's kind)
            code = self._code(col[0])
            idx = arrays.nulls(len(col), pa.int32()) if code < 0 else \
                arrays.indices(np.full(len(col), code, np.int32))
            return pa.DictionaryArray.from_arrays(idx, self._dictionary())
        get = self.index.__getitem__
        try:
            codes = np.fromiter(map(get, col), np.int32, len(col))
        except KeyError:       # values not seen before: given their codes in order
            for v in dict.fromkeys(col):
                if v not in self.index:
                    self._code(v)
            codes = np.fromiter(map(get, col), np.int32, len(col))
        return self._array(codes)

    def encode_arrow(self, col: pa.Array | pa.ChunkedArray) -> pa.DictionaryArray:
        """Encode a string column against the growing dictionary (vectorized: only the
        distinct values of the column go through Python)."""
        if isinstance(col, pa.ChunkedArray):
            col = col.combine_chunks()
        if pa.types.is_dictionary(col.type):
            col = col.cast(pa.string())
        enc = pc.dictionary_encode(col)
        mapping = np.fromiter(map(self._code, enc.dictionary.to_pylist()), np.int32,
                              len(enc.dictionary))
        idx = enc.indices
        codes = mapping[arrays.values(idx, 0)] if len(mapping) else np.zeros(len(idx), np.int32)
        if idx.null_count:
            codes[arrays.values(idx.is_null())] = -1
        return self._array(codes)


class TraceWriter:
    """Append rows to a trace file. Every `write_rows` call becomes one durable batch.

    Write errors (disk full, file size limit, a directory that went away) turn the writer
    off, and are said once on stderr unless `quiet` (the caller says them); what was written
    stays readable. `error` and `errno` tell what happened.
    """

    def __init__(self, path: str | os.PathLike[str], metadata: dict[str, Any],
                 quiet: bool = False) -> None:
        self.path = os.fspath(path)
        self.schema = schema(metadata)
        self.rows_written = 0
        self.quiet = quiet
        self.error: str | None = None
        self.errno = 0
        self._encoders = {name: _DictEncoder() for name in DICT_COLUMNS}
        self._sink = pa.OSFile(self.path, "wb")
        opts = pa.ipc.IpcWriteOptions(compression=_COMPRESSION, emit_dictionary_deltas=True)
        self._writer: pa.ipc.RecordBatchFileWriter | None = pa.ipc.new_file(
            self._sink, self.schema, options=opts
        )

    def _fail(self, e: BaseException) -> None:
        write_failed(self, e)
        self._writer = None

    def raise_error(self) -> None:
        """Raise the write error, if there was one, as an OSError."""
        if self.error:
            raise OSError(self.errno, self.error)

    def write_rows(self, rows: Sequence[Row]) -> None:
        if rows:
            self.write_columns(row_columns(rows))

    def write_columns(self, columns: Sequence[Sequence[Any]]) -> None:
        """One batch from Python sequences, one per column in schema order, of equal length
        (trailing extension columns may be left out: null)."""
        if not columns or not len(columns[0]) or self._writer is None:
            return
        columns = [*columns, *[(None,) * len(columns[0])] * (len(COLUMNS) - len(columns))]
        out = column_arrays(columns, range(len(COLUMNS)), self._encoders)
        self._write_batch(pa.RecordBatch.from_arrays(out, schema=self.schema))

    def write_table(self, table: pa.Table, max_rows: int = 1 << 20) -> None:
        """Write a table already in schema order, in batches; dictionaries grow by deltas, so
        this may be called many times."""
        if self._writer is None:
            return
        for lo in range(0, max(table.num_rows, 1), max_rows):
            part = table.slice(lo, max_rows)
            if part.num_rows == 0:
                break
            cols = []
            for (name, typ, _, _), col in zip(COLUMNS, part.columns, strict=False):
                if name in DICT_COLUMNS:
                    col = self._encoders[name].encode_arrow(col)
                elif col.type != typ:
                    col = col.cast(typ)
                cols.append(col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col)
            self._write_batch(pa.RecordBatch.from_arrays(cols, schema=self.schema))

    def _write_batch(self, batch: pa.RecordBatch) -> None:
        assert self._writer is not None
        try:
            self._writer.write_batch(batch)
            self._sink.flush()
        except (OSError, pa.ArrowException) as e:
            self._fail(e)
            return
        self.rows_written += batch.num_rows

    def close(self) -> None:
        w, self._writer = self._writer, None
        try:
            if w is not None:
                w.close()
            self._sink.close()
        except (OSError, pa.ArrowException) as e:
            self._fail(e)


def column_arrays(columns: Sequence[Sequence[Any]], at: Iterable[int],
                  encoders: dict[str, _DictEncoder] | None = None) -> list[pa.Array]:
    """Python sequences (None: null) as the Arrow arrays of the trace's columns at `at`
    (`encoders`: the growing dictionaries of a file's string columns)."""
    out = []
    for i, col in zip(at, columns, strict=True):
        name, typ, _, _ = COLUMNS[i]
        if name in DICT_COLUMNS:
            enc = encoders[name] if encoders is not None else _DictEncoder()
            out.append(enc.encode(col))
        elif pa.types.is_string(typ):
            out.append(arrays.strings(col))
        else:
            out.append(arrays.numbers(col, typ))
    return out


def row_columns(rows: Sequence[Row]) -> list[tuple[Any, ...]]:
    """Rows as the schema's columns; rows may leave out trailing extension columns (null)."""
    width = len(COLUMNS)
    if any(len(r) != width for r in rows):
        rows = [tuple(r) + (None,) * (width - len(r)) for r in rows]
    return list(zip(*rows, strict=True))


def write_trace(path: str | os.PathLike[str], metadata: dict[str, Any],
                rows: Iterable[Row] = (), table: pa.Table | None = None) -> None:
    """Write a whole trace at once (tests, importers, merges)."""
    w = TraceWriter(path, metadata, quiet=True)
    try:
        if table is not None:
            w.write_table(table)
        rows = list(rows)
        if rows:
            w.write_rows(rows)
    finally:
        w.close()
    w.raise_error()


def by_rank(table: pa.Table) -> pa.Table:
    """The table sorted by (rank, start); as it is (no copy) when it already is."""
    import numpy as np

    if table.num_rows < 2:
        return table
    rank_col, start_col = table.column("rank"), table.column("start_ns")
    if not rank_col.null_count and not start_col.null_count:
        rank, start = np.diff(arrays.values(rank_col)), np.diff(arrays.values(start_col))
        if np.all((rank > 0) | ((rank == 0) & (start >= 0))):
            return table
    return table.sort_by([("rank", "ascending"), ("start_ns", "ascending")])


def write_ranks(path: str | os.PathLike[str], metadata: dict[str, Any],
                tables: Iterable[pa.Table]) -> None:
    """Write a trace from tables of one rank each, in rank order, sorted by start: no record
    batch holds two ranks, so a reader can take one rank at a time
    (`trace.ranked.open_by_rank`). Raises OSError where the file could not be written."""
    w = TraceWriter(path, metadata, quiet=True)
    try:
        for table in tables:
            w.write_table(table)
            del table   # one rank held at a time, not this one beside the next
    finally:
        w.close()
    w.raise_error()


def write_by_rank(path: str | os.PathLike[str], metadata: dict[str, Any],
                  table: pa.Table) -> None:
    """Write a whole trace sorted by (rank, start), one rank per record batch."""
    import numpy as np

    table = by_rank(table)
    cuts: Any = []
    if table.num_rows:
        rank = arrays.values(table.column("rank"), -(2**31))   # null ranks sort last: a run of them
        cuts = np.concatenate(([0], np.flatnonzero(np.diff(rank)) + 1, [rank.size]))
    write_ranks(path, metadata, (table.slice(int(lo), int(hi - lo))
                                 for lo, hi in zip(cuts[:-1], cuts[1:], strict=True)))
