"""Trace format v1: the columns, their types and the schema metadata."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import pyarrow as pa

FORMAT = "gputrace-trace"
VERSION = 1
METADATA_KEY = b"gputrace"

_DICT = pa.dictionary(pa.int32(), pa.string())

# (name, type, nullable, default used when an older file lacks the column)
COLUMNS: list[tuple[str, pa.DataType, bool, Any]] = [
    ("kind", _DICT, False, "span"),
    ("cat", _DICT, False, "user"),
    ("name", _DICT, False, ""),
    ("start_ns", pa.int64(), False, 0),
    ("end_ns", pa.int64(), True, None),
    ("value", pa.float64(), True, None),
    ("unit", _DICT, True, None),
    ("host", _DICT, False, ""),
    ("rank", pa.int32(), False, -1),
    ("pid", pa.int32(), False, -1),
    ("tid", pa.int64(), False, -1),
    ("device", pa.int16(), False, -1),
    ("stream", pa.int32(), False, -1),
    ("step", pa.int32(), False, -1),
    ("layer", pa.int32(), False, -1),
    ("bytes", pa.int64(), True, None),
    ("src_kind", _DICT, True, None),
    ("dst_kind", _DICT, True, None),
    ("corr", pa.int64(), True, None),
    ("args", pa.string(), True, None),
    # extension: the phase a GPU kernel/memcpy is attributed to (its launch's enclosing range)
    ("phase", _DICT, True, None),
    # extension: when the host call that launched a GPU record was made (trace clock, ns);
    # a GPU record belongs to the iteration holding its launch, wherever it ran in time
    ("launch_ns", pa.int64(), True, None),
]
COLUMN_NAMES = [c[0] for c in COLUMNS]
DICT_COLUMNS = frozenset(n for n, t, _, _ in COLUMNS if pa.types.is_dictionary(t))
DEFAULTS = {n: d for n, _, _, d in COLUMNS}

SPAN_CATS = (
    "iteration io h2d forward backward update comm kernel memcpy memset sync user framework"
    .split()
)
SAMPLE_CATS = "gpu host disk net ib pcie nvlink cpu".split()

class TraceFormatError(Exception):
    """The file is not a gputrace trace this version can read."""


def schema(metadata: dict[str, Any] | None = None) -> pa.Schema:
    fields = [pa.field(n, t, nullable=nl) for n, t, nl, _ in COLUMNS]
    md = None
    if metadata is not None:
        md = {METADATA_KEY: json.dumps(dict(metadata, format=FORMAT, version=VERSION)).encode()}
    return pa.schema(fields, metadata=md)


def read_metadata(sch: pa.Schema) -> dict[str, Any]:
    """Return the `gputrace` metadata of a schema, refusing files this version cannot read."""
    raw = (sch.metadata or {}).get(METADATA_KEY)
    if raw is None:
        raise TraceFormatError("not a gputrace trace (no 'gputrace' schema metadata)")
    try:
        md = json.loads(raw)
    except ValueError as e:
        raise TraceFormatError(f"corrupt trace metadata: {e}") from None
    if not isinstance(md, dict) or md.get("format") != FORMAT:
        raise TraceFormatError("not a gputrace trace (metadata format is not 'gputrace-trace')")
    version = md.get("version")
    if not isinstance(version, int) or version < 1:
        raise TraceFormatError(f"unknown trace version {version!r}")
    if version > VERSION:
        raise TraceFormatError(
            f"trace format version {version} is newer than this gputrace reads ({VERSION}); "
            "upgrade gputrace"
        )
    return md


def conform(table: pa.Table, only: Iterable[str] | None = None) -> pa.Table:
    """Give a table every v1 column in order (missing ones take their default); keep extras.
    With `only`, just those v1 columns (and no extras)."""
    n = table.num_rows
    want = None if only is None else set(only)
    cols, names = [], []
    for name, typ, _, default in COLUMNS:
        if want is not None and name not in want:
            continue
        if name in table.column_names:
            col = table.column(name)
            if col.type != typ:
                try:
                    col = col.cast(typ)
                except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError):
                    raise TraceFormatError(f"column {name} holds {col.type}, not "
                                           f"{typ}: not a gputrace trace") from None
        else:
            base = typ.value_type if pa.types.is_dictionary(typ) else typ
            col = pa.chunked_array([pa.array([default] * n, base)]).cast(typ) if n else \
                pa.chunked_array([], typ)
        cols.append(col)
        names.append(name)
    for name in table.column_names if want is None else ():
        if name not in DEFAULTS:
            cols.append(table.column(name))
            names.append(name)
    return pa.Table.from_arrays(cols, names=names)
