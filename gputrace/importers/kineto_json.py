"""Kineto / Chrome trace JSON as gputrace reads it: the file's top level, its events as raw
slices of the text decoded 65536 at a time by msgspec into structs of only the fields gputrace
uses, and the checked readers of their values."""

from __future__ import annotations

import gzip
import math
from typing import Any

import msgspec

from gputrace.importers.common import ImportFailed

_DTYPE_BYTES = {"float": 4, "float32": 4, "int": 4, "int32": 4, "half": 2, "float16": 2,
                "bfloat16": 2, "bf16": 2, "double": 8, "float64": 8, "long": 8, "int64": 8,
                "int8": 1, "uint8": 1, "char": 1, "bool": 1, "byte": 1}
MAX_NS = 2**62
UNSET = msgspec.UNSET


class Args(msgspec.Struct, gc=False):
    """The `args` keys gputrace reads (UNSET: absent)."""

    correlation: Any = UNSET
    device: Any = UNSET
    stream: Any = UNSET
    nbytes: Any = msgspec.field(default=UNSET, name="bytes")
    in_nelems: Any = msgspec.field(default=UNSET, name="In msg nelems")
    out_nelems: Any = msgspec.field(default=UNSET, name="Out msg nelems")
    dtype: Any = UNSET
    # the process group of a collective: on `record_param_comms` CPU ops and, in recent
    # PyTorch, on the NCCL kernels themselves
    ext: Any = msgspec.field(default=UNSET, name="External id")
    pg_name: Any = msgspec.field(default=UNSET, name="Process Group Name")
    pg_desc: Any = msgspec.field(default=UNSET, name="Process Group Description")
    pg_ranks: Any = msgspec.field(default=UNSET, name="Process Group Ranks")
    group_size: Any = msgspec.field(default=UNSET, name="Group size")


# Args' fields and the keys they are read from
ARG_KEYS = (("correlation", "correlation"), ("device", "device"), ("stream", "stream"),
            ("nbytes", "bytes"), ("in_nelems", "In msg nelems"),
            ("out_nelems", "Out msg nelems"), ("dtype", "dtype"), ("ext", "External id"),
            ("pg_name", "Process Group Name"), ("pg_desc", "Process Group Description"),
            ("pg_ranks", "Process Group Ranks"), ("group_size", "Group size"))


class Event(msgspec.Struct, gc=False):
    ph: Any = None
    cat: Any = ""
    name: Any = None
    ts: Any = None
    dur: Any = 0
    pid: Any = None
    tid: Any = None
    args: Args | None = None


class _Top(msgspec.Struct):
    traceEvents: list[msgspec.Raw] | None = None
    baseTimeNanoseconds: Any = None
    distributedInfo: Any = None


class _Doc:
    """A file's text and its top level, the events as raw slices of that text."""

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            with open(path, "rb") as f:
                gz = f.read(2) == b"\x1f\x8b"
            if gz:
                with gzip.open(path, "rb") as f:
                    self.text = f.read()
            else:
                with open(path, "rb") as f:
                    self.text = f.read()
        except (EOFError, gzip.BadGzipFile, OSError) as e:
            if isinstance(e, FileNotFoundError | PermissionError):
                raise
            raise ImportFailed(f"cannot decompress or read: {e}") from None
        try:
            self.top = msgspec.json.decode(self.text, type=_Top)
        except RecursionError:
            raise ImportFailed("not valid JSON for a trace: nested too deeply") from None
        except msgspec.ValidationError:   # not an object, or its traceEvents not a list
            self.top = _Top()
            try:   # what it holds besides, when it is an object
                top = msgspec.json.decode(self.text)
            except (msgspec.DecodeError, RecursionError):
                top = None
            if isinstance(top, dict):
                self.top.baseTimeNanoseconds = top.get("baseTimeNanoseconds")
                self.top.distributedInfo = top.get("distributedInfo")
        except msgspec.DecodeError as e:
            raise ImportFailed(f"not valid JSON: {str(e).splitlines()[0][:120]}") from None


_last: _Doc | None = None    # the file `top_level` parsed, for the `read` that follows


def document(path: str, keep: bool = False) -> _Doc:
    global _last
    doc = _last if _last is not None and _last.path == path else None
    _last = None
    if doc is None:
        doc = _Doc(path)
    if keep:
        _last = doc
    return doc


def top_level(path: str, key: str) -> Any:
    """One top-level value (`distributedInfo`, `baseTimeNanoseconds`); the parsed file is kept
    for the `read` of the same path that follows."""
    return getattr(document(path, keep=True).top, key, None)


_GENERIC = msgspec.json.Decoder()


def _loose(raw: msgspec.Raw, n: int) -> Event:
    """An event whose fields are not of the types `Event` takes, as the importer reads it:
    an `args` that is not an object is no args; anything not an object is refused."""
    ev = _GENERIC.decode(raw)
    if not isinstance(ev, dict):
        raise ImportFailed(f"event {n} is {type(ev).__name__}, not an object")
    args = ev.get("args")
    a = None
    if isinstance(args, dict):
        a = Args(**{k: args[key] for k, key in ARG_KEYS if key in args})
    return Event(ev.get("ph"), ev.get("cat", ""), ev.get("name"), ev.get("ts"),
                  ev.get("dur", 0), ev.get("pid"), ev.get("tid"), a)


_BATCH_DECODER = msgspec.json.Decoder(list[Event])


def events(raws: list[msgspec.Raw], first: int) -> list[Event]:
    try:
        return _BATCH_DECODER.decode(b"[%b]" % b",".join(raws))
    except RecursionError:
        raise ImportFailed(f"an event after event {first} is nested too deeply") from None
    except msgspec.ValidationError:
        return [_loose(r, first + i) for i, r in enumerate(raws)]


def as_int(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        return -1
    return int(v) if -2**62 < v < 2**62 else -1


def as_ns(v: Any, what: str, n: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise ImportFailed(f"event {n}: '{what}' is {v!r}, not a number of microseconds")
    ns = round(v * 1000)
    if not -MAX_NS < ns < MAX_NS:
        raise ImportFailed(f"event {n}: '{what}' = {v!r} is out of range")
    return ns


def comm_bytes(args: Args | None) -> int | None:
    if args is None:
        return None
    for n in (args.in_nelems, args.out_nelems):
        if isinstance(n, int) and n >= 0:
            size = _DTYPE_BYTES.get(str("" if args.dtype is UNSET else args.dtype).lower())
            return n * size if size else None
    return None
