"""A rank's per-iteration summary held compressed while the other ranks are analyzed.

The command that combines a run's ranks holds every rank's part until the last one is in;
at 1e8 events over 1024 ranks the parts were the largest thing it held (~240 KB each, ~90 %
of it the comm units' and terms' arrays). Each numpy buffer of the pickled object is
byte-shuffled (the k-th byte of every element together: timestamps in ns differ in their
low bytes only) and compressed with LZ4 (pyarrow's), losslessly; where it compresses
better, each element is first replaced by its difference from the one before (as unsigned
integers, wrapping: sorted timestamps become small steps whose high bytes are all zero).
Unpacking gives the same arrays back, bit for bit. Small or incompressible buffers stay as
they are."""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import numpy as np
import pyarrow as pa

CODEC = "lz4"
SMALL = 512          # bytes: a buffer this small is kept as it is
GAIN = 0.8           # a compressed buffer is kept only under this share of its size

T = TypeVar("T")
K = TypeVar("K")


@dataclass(frozen=True)
class Packed(Generic[T]):
    """An object pickled with its buffers apart, each (size, element width, differenced,
    bytes): size None where the buffer is kept as it is."""

    head: bytes
    buffers: tuple[tuple[int | None, int, bool, bytes], ...]

    @property
    def nbytes(self) -> int:
        return len(self.head) + sum(len(b) for *_, b in self.buffers)

    def unpack(self) -> T:
        out: list[Any] = []      # writable buffers: the arrays come back as they were
        for n, w, diffed, b in self.buffers:
            if n is None:
                out.append(bytearray(b))
                continue
            raw = np.frombuffer(pa.decompress(b, decompressed_size=n, codec=CODEC,
                                              asbytes=True), np.uint8)
            a = _unshuffled(raw, w) if w > 1 else raw.copy()
            if diffed:
                v = a.reshape(-1).view(_UINT[w])
                np.cumsum(v, out=v)          # wraps as the differences did
            out.append(a)
        return pickle.loads(self.head, buffers=out)


def _unshuffled(raw: np.ndarray, w: int) -> np.ndarray:
    """Bytes back in element order: a column at a time (twice as fast as a transposed
    copy)."""
    planes = raw.reshape(w, -1)
    out = np.empty((planes.shape[1], w), np.uint8)
    for i in range(w):
        out[:, i] = planes[i]
    return out


_UINT = {4: np.uint32, 8: np.uint64}


def _shuffled(a: np.ndarray, w: int) -> bytes:
    return pa.compress(a.reshape(-1, w).T.tobytes() if w > 1 else a.tobytes(), codec=CODEC,
                       asbytes=True)


def _buffer(view: memoryview) -> tuple[int | None, int, bool, bytes]:
    raw = view.cast("B") if view.ndim != 1 or view.format != "B" else view
    n = raw.nbytes
    if n < SMALL:
        return None, 1, False, bytes(raw)
    a = np.frombuffer(raw, np.uint8)
    w = 8 if n % 8 == 0 else 4 if n % 4 == 0 else 1
    tried = [(_shuffled(a, w), False)]
    if w > 1:
        v = a.view(_UINT[w])
        steps = np.empty_like(v)
        steps[0] = v[0]
        np.subtract(v[1:], v[:-1], out=steps[1:])
        tried.append((_shuffled(steps.view(np.uint8), w), True))
    c, diffed = min(tried, key=lambda t: len(t[0]))
    return (n, w, diffed, c) if len(c) < GAIN * n else (None, 1, False, bytes(raw))


class _Pickler(pickle.Pickler):
    """Every array's buffer apart: pickle keeps a strided view's elements in its stream
    (a column of a matrix; unpacked, it comes back contiguous)."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, np.ndarray) and not (obj.flags.c_contiguous
                                                or obj.flags.f_contiguous):
            return np.ascontiguousarray(obj).__reduce_ex__(5)
        return NotImplemented


def pack(obj: T) -> Packed[T]:
    """`obj` pickled, its numpy buffers shuffled and compressed."""
    bufs: list[pickle.PickleBuffer] = []
    out = io.BytesIO()
    _Pickler(out, protocol=5, buffer_callback=bufs.append).dump(obj)
    return Packed(out.getvalue(), tuple(_buffer(b.raw()) for b in bufs))


def unpacked(x: T | Packed[T]) -> T:
    """`x` itself, or unpacked where it is held packed."""
    return x.unpack() if isinstance(x, Packed) else x


class Unpacking(Mapping[K, T]):
    """A mapping whose values are unpacked each time they are read (`get` of the item
    held): read one at a time, only one is whole at once."""

    def __init__(self, held: Mapping[K, Any], get: Callable[[Any], T]) -> None:
        self._held, self._get = held, get

    def __getitem__(self, key: K) -> T:
        return self._get(self._held[key])

    def __contains__(self, key: object) -> bool:
        return key in self._held

    def __iter__(self) -> Iterator[K]:
        return iter(self._held)

    def __len__(self) -> int:
        return len(self._held)
