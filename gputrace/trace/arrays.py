"""Arrow arrays from Python values without pyarrow's pandas shim.

`pa.array` asks pyarrow whether pandas is installed, and the first time it asks, pyarrow
imports pandas: seconds of CPU inside the training job, a module lock held across the job's
`fork()` of its DataLoader workers (a child that then imports pandas hangs), and an error at
interpreter exit ("can't register atexit after shutdown") that loses the last batch. The
writer (and the reader of a job's shards, which may run in a job's process through the
public API) builds its arrays from numpy buffers instead, which asks nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa

_NUMPY = {pa.int64(): np.int64, pa.int32(): np.int32, pa.int16(): np.int16,
          pa.int8(): np.int8, pa.float64(): np.float64, pa.float32(): np.float32}


def _validity(isnull: np.ndarray) -> tuple[pa.Buffer | None, int]:
    n = int(isnull.sum())
    if not n:
        return None, 0
    return pa.py_buffer(np.packbits(~isnull, bitorder="little")), n


def nulls(n: int, typ: pa.DataType) -> pa.Array:
    """A column of n nulls of a numeric or string type, from one zeroed buffer (pa.nulls
    builds it value by value)."""
    zero = pa.py_buffer(bytes(max(n * 8, 8) + 8))
    if pa.types.is_string(typ):
        return pa.Array.from_buffers(typ, n, [zero, zero, zero], null_count=n)
    return pa.Array.from_buffers(typ, n, [zero, zero], null_count=n)


def numbers(col: Sequence[Any], typ: pa.DataType) -> pa.Array:
    """A numeric column (None: null)."""
    dt = _NUMPY[typ]
    n = len(col)
    if not n:
        values = np.zeros(0, dtype=dt)
        valid, count = None, 0
    elif col.count(col[0]) == n:   # one value throughout (a span's pid, rank, device)
        if col[0] is None:
            return nulls(n, typ)
        values = np.full(n, col[0], dtype=dt)
        valid, count = None, 0
    elif not col.count(None):
        values = np.fromiter(col, dtype=dt, count=n)
        valid, count = None, 0
    else:
        isnull = np.fromiter((v is None for v in col), dtype=bool, count=n)
        values = np.fromiter((0 if v is None else v for v in col), dtype=dt, count=n)
        valid, count = _validity(isnull)
    return pa.Array.from_buffers(typ, n, [valid, pa.py_buffer(values)], null_count=count)


def indices(codes: np.ndarray, isnull: np.ndarray | None = None) -> pa.Array:
    """int32 dictionary indices (`isnull`: where they are null)."""
    codes = np.ascontiguousarray(codes, dtype=np.int32)
    valid, count = _validity(isnull) if isnull is not None else (None, 0)
    return pa.Array.from_buffers(pa.int32(), len(codes), [valid, pa.py_buffer(codes)],
                                 null_count=count)


def strings(col: Sequence[str | None]) -> pa.Array:
    """A string column (None: null)."""
    n = len(col)
    if n and col.count(None) == n:
        return nulls(n, pa.string())
    data = [b"" if v is None else str(v).encode("utf-8", "replace") for v in col]
    offsets = np.zeros(n + 1, dtype=np.int64)
    if n:
        np.cumsum(np.fromiter(map(len, data), dtype=np.int64, count=n), out=offsets[1:])
    isnull = np.fromiter((v is None for v in col), dtype=bool, count=n)
    valid, count = _validity(isnull)
    if offsets[-1] < 2**31:
        typ, offsets = pa.string(), offsets.astype(np.int32)
    else:
        typ = pa.large_string()
    arr = pa.Array.from_buffers(typ, n, [valid, pa.py_buffer(offsets),
                                         pa.py_buffer(b"".join(data))], null_count=count)
    return arr if typ == pa.string() else arr.cast(pa.string())


def scalar(value: int | float, typ: pa.DataType) -> pa.Scalar:
    """A numeric scalar of `typ` (pa.scalar asks pyarrow's pandas shim, as pa.array does;
    a compute function given a Python number makes one with it)."""
    return numbers([value], typ)[0]


def values(col: pa.Array | pa.ChunkedArray, fill: int | float = 0) -> np.ndarray:
    """A numeric or boolean column as a numpy array (nulls as `fill`), read from its buffers:
    `to_numpy` asks pyarrow's pandas shim too, which imports pandas the first time."""
    chunks = col.chunks if isinstance(col, pa.ChunkedArray) else [col]
    boolean = pa.types.is_boolean(col.type)
    dt = np.dtype(bool) if boolean else np.dtype(_NUMPY[col.type])
    out = []
    for ch in chunks:
        n, off = len(ch), ch.offset
        if not n:
            continue
        valid_buf, data = ch.buffers()[:2]
        if boolean:
            v = _bits(data, off, n)
        else:
            v = np.frombuffer(data, dtype=dt, count=n, offset=off * dt.itemsize)
        if ch.null_count:
            v = np.where(_bits(valid_buf, off, n), v, np.array(fill, dtype=dt))
        out.append(v)
    if not out:
        return np.zeros(0, dtype=dt)
    return np.concatenate(out) if len(out) > 1 else np.array(out[0])


def _bits(buf: pa.Buffer, off: int, n: int) -> np.ndarray:
    """n bits of an Arrow bitmap from bit `off`, as booleans."""
    return np.unpackbits(np.frombuffer(buf, dtype=np.uint8), bitorder="little"
                         )[off:off + n].astype(bool)
