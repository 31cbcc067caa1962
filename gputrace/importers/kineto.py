"""Kineto (PyTorch profiler) / Chrome trace JSON -> trace v1 rows.

The file is read whole and parsed by msgspec into typed structs of only the fields gputrace
uses: the event list first as raw slices of the text (a few dozen bytes each), then 65536
events at a time into structs, converted and dropped, so memory follows the JSON text and the
output rows, not a Python object of every event."""

from __future__ import annotations

import gzip
import math
import os
import re
from collections.abc import Sequence
from typing import Any

import msgspec

from gputrace.importers.common import (
    HostOps,
    ImportFailed,
    Launches,
    Rows,
    attribute_launches,
    is_nccl,
    loop_threads,
    memcpy_kinds,
    op_kind,
    phase_of,
)

_RANK_IN_NAME = re.compile(r"rank[-_]?(\d+)", re.IGNORECASE)
_DTYPE_BYTES = {"float": 4, "float32": 4, "int": 4, "int32": 4, "half": 2, "float16": 2,
                "bfloat16": 2, "bf16": 2, "double": 8, "float64": 8, "long": 8, "int64": 8,
                "int8": 1, "uint8": 1, "char": 1, "bool": 1, "byte": 1}
_MAX_NS = 2**62
_BATCH = 1 << 16
UNSET = msgspec.UNSET


class _Args(msgspec.Struct):
    """The `args` keys gputrace reads (UNSET: absent)."""

    correlation: Any = UNSET
    device: Any = UNSET
    stream: Any = UNSET
    nbytes: Any = msgspec.field(default=UNSET, name="bytes")
    in_nelems: Any = msgspec.field(default=UNSET, name="In msg nelems")
    out_nelems: Any = msgspec.field(default=UNSET, name="Out msg nelems")
    dtype: Any = UNSET


class _Event(msgspec.Struct):
    ph: Any = None
    cat: Any = ""
    name: Any = None
    ts: Any = None
    dur: Any = 0
    pid: Any = None
    tid: Any = None
    args: _Args | None = None


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


_last: _Doc | None = None    # the file `_top_level` parsed, for the `read` that follows


def _document(path: str, keep: bool = False) -> _Doc:
    global _last
    doc = _last if _last is not None and _last.path == path else None
    _last = None
    if doc is None:
        doc = _Doc(path)
    if keep:
        _last = doc
    return doc


def _top_level(path: str, key: str) -> Any:
    """One top-level value (`distributedInfo`, `baseTimeNanoseconds`); the parsed file is kept
    for the `read` of the same path that follows."""
    return getattr(_document(path, keep=True).top, key, None)


_GENERIC = msgspec.json.Decoder()
_TYPED = msgspec.json.Decoder(_Event)


def _loose(raw: msgspec.Raw, n: int) -> _Event:
    """An event whose fields are not of the types `_Event` takes, as the importer reads it:
    an `args` that is not an object is no args; anything not an object is refused."""
    ev = _GENERIC.decode(raw)
    if not isinstance(ev, dict):
        raise ImportFailed(f"event {n} is {type(ev).__name__}, not an object")
    args = ev.get("args")
    a = None
    if isinstance(args, dict):
        a = _Args(**{k: args[key] for k, key in (
            ("correlation", "correlation"), ("device", "device"), ("stream", "stream"),
            ("nbytes", "bytes"), ("in_nelems", "In msg nelems"),
            ("out_nelems", "Out msg nelems"), ("dtype", "dtype")) if key in args})
    return _Event(ev.get("ph"), ev.get("cat", ""), ev.get("name"), ev.get("ts"),
                  ev.get("dur", 0), ev.get("pid"), ev.get("tid"), a)


def _events(raws: list[msgspec.Raw], first: int) -> list[_Event]:
    try:
        return [_TYPED.decode(r) for r in raws]
    except RecursionError:
        raise ImportFailed(f"an event after event {first} is nested too deeply") from None
    except msgspec.ValidationError:
        return [_loose(r, first + i) for i, r in enumerate(raws)]


def _int(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        return -1
    return int(v) if -2**62 < v < 2**62 else -1


def _ns(v: Any, what: str, n: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise ImportFailed(f"event {n}: '{what}' is {v!r}, not a number of microseconds")
    ns = round(v * 1000)
    if not -_MAX_NS < ns < _MAX_NS:
        raise ImportFailed(f"event {n}: '{what}' = {v!r} is out of range")
    return ns


def _comm_bytes(args: _Args | None) -> int | None:
    if args is None:
        return None
    for n in (args.in_nelems, args.out_nelems):
        if isinstance(n, int) and n >= 0:
            size = _DTYPE_BYTES.get(str("" if args.dtype is UNSET else args.dtype).lower())
            return n * size if size else None
    return None


def rank_of(path: str, dist: Any) -> int | None:
    if isinstance(dist, dict) and isinstance(dist.get("rank"), int) and dist["rank"] >= 0:
        return int(dist["rank"])
    m = _RANK_IN_NAME.search(os.path.basename(path))
    return int(m.group(1)) if m else None


_PTHREAD_MASK = 0xFFFFFFFF


def read(path: str, rank: int, rows: Rows, *, phases: Sequence[tuple[Any, int, int, str]] = (),
         iters: Sequence[tuple[int, int, int]] = (), gpu_only: bool = False,
         threads: dict[int, int] | None = None, loops: dict[int, Any] | None = None
         ) -> dict[str, Any]:
    """Append one Kineto file's events to `rows` as `rank`; return what the file says of itself.

    `phases` ((pid, tid), start, end, cat) and `iters` (start, end, step) add ranges known
    from elsewhere (gputrace's own spans) for attributing GPU work to the range of its
    launch; `gpu_only` leaves out the file's CPU-side ranges. `threads` maps pthread ids
    (low 32 bits) to native TIDs: Kineto names a launching thread it saw no operator on by
    the low 32 bits of its pthread_self, as a signed int. `loops`: pid -> (pid, tid) of the
    training loop's thread (found from the file's iterations or phases when not given).

    Where the file does not name forward and backward (torch.profiler without module
    ranges), they are found from the order of the loop thread's operators (see
    `HostOps.infer`) and written as `forward`/`backward` spans named `... (inferred)`."""
    launches = Launches()
    fixed: set[int] = set()
    h2d: set[int] = set()
    phases = list(phases)
    iters = list(iters)
    iter_threads: dict[Any, int] = {}
    ops = HostOps()
    counts = {"events": 0, "skipped": 0}
    doc = _document(path)
    base = doc.top.baseTimeNanoseconds
    base_ns = _int(base) if base is not None else 0
    if base_ns < 0:
        raise ImportFailed(f"baseTimeNanoseconds = {base!r} is not a time in ns")
    raws = doc.top.traceEvents or []
    doc.top.traceEvents = None
    del doc
    for lo in range(0, len(raws), _BATCH):
        _convert(_events(raws[lo:lo + _BATCH], lo), lo, rank, rows, base_ns, gpu_only,
                 threads, launches, fixed, h2d, phases, iters, iter_threads, ops, counts)
    counts["events"] = len(raws)
    del raws
    if counts["events"] == 0:
        raise ImportFailed("no 'traceEvents' in it: not a Kineto/Chrome trace")
    if loops is None:
        loops = loop_threads(phases, iter_threads)
    inferred = ops.infer(loops)
    for (pid, tid), s, e, cat in inferred:
        rows.add("span", cat, f"{cat} (inferred)", s, e, rank=rank, pid=pid, tid=tid)
    counts["inferred_phases"] = len(inferred)
    attribute_launches(rows, phases + inferred, iters, launches, fixed, loops, h2d)
    return counts


_GPU = frozenset(("kernel", "gpu_memcpy", "memcpy", "gpu_memset", "memset"))
_RUNTIME = frozenset(("cuda_runtime", "cuda_driver", "runtime"))
_HOST = frozenset(("cpu_op", "user_annotation", "python_function", "operator",
                   "gpu_user_annotation"))
_COLS = ("cat", "name", "start_ns", "end_ns", "pid", "tid", "device", "stream", "step",
         "bytes", "src_kind", "dst_kind", "corr", "phase")


def _convert(evs: list[_Event], first: int, rank: int, rows: Rows, base_ns: int,
             gpu_only: bool, threads: dict[int, int] | None, launches: Launches,
             fixed: set[int], h2d: set[int], phases: list[tuple[Any, int, int, str]],
             iters: list[tuple[int, int, int]], iter_threads: dict[Any, int], ops: HostOps,
             counts: dict[str, Any]) -> None:
    """One batch of events as rows (a column list each, in file order), appended at once."""
    cols: dict[str, list[Any]] = {c: [] for c in _COLS}
    (cat_c, name_c, start_c, end_c, pid_c, tid_c, dev_c, stream_c, step_c, bytes_c, src_c,
     dst_c, corr_c, phase_c) = (cols[c] for c in _COLS)
    at = rows.count                      # the index the next row will get
    gpu_work: list[int] = []             # (row, corr) of GPU records, flat
    calls: list[int] = []                # (corr, pid, tid, t) of API calls, flat
    host_ops: list[int] = []
    cats: dict[Any, str] = {}
    skipped = 0
    for j, ev in enumerate(evs):
        if ev.ph != "X":
            skipped += 1
            continue
        cat = cats.get(ev.cat)
        if cat is None:
            cat = cats[ev.cat] = str(ev.cat).lower()
        if cat not in _GPU and cat not in _RUNTIME and (gpu_only or cat not in _HOST):
            skipped += 1
            continue
        n = first + j
        name = ev.name
        if not isinstance(name, str):
            name = str(name)
        a = ev.args
        start = _ns(ev.ts, "ts", n) + base_ns
        end = start + max(_ns(ev.dur, "dur", n), 0)
        pid, tid = _int(ev.pid), _int(ev.tid)
        corr = _int(a.correlation) if a is not None else -1
        if cat in _GPU:
            dev = _int(pid if a is None or a.device is UNSET else a.device)
            stream = _int(tid if a is None or a.stream is UNSET else a.stream)
            src = dst = phase = None
            nb = None
            if cat == "kernel":
                if is_nccl(name):
                    kind, phase, nb = "comm", "comm", _comm_bytes(a)
                    fixed.add(at)
                else:
                    kind = "kernel"
            elif "memcpy" in cat:
                kind = "memcpy"
                src, dst = memcpy_kinds(name)
                b = _int(a.nbytes) if a is not None else -1
                nb = b if b >= 0 else None
                if dst == "device" and src in ("pageable", "pinned"):
                    h2d.add(at)
            else:
                kind = "memset"
                b = _int(a.nbytes) if a is not None else -1
                nb = b if b >= 0 else None
            cat_c.append(kind)
            pid_c.append(-1)
            tid_c.append(-1)
            dev_c.append(dev)
            stream_c.append(stream)
            step_c.append(-1)
            corr_c.append(corr if corr >= 0 else None)
            phase_c.append(phase)
            bytes_c.append(nb)
            src_c.append(src)
            dst_c.append(dst)
            if corr >= 0:                   # no correlation (-1): not matched
                gpu_work += (at, corr)
        elif cat in _RUNTIME:
            if threads and tid & _PTHREAD_MASK in threads:
                tid = threads[tid & _PTHREAD_MASK]
            if corr >= 0:
                calls += (corr, pid, tid, start)
            if "ynchronize" not in name:
                continue
            cat_c.append("sync")
            pid_c.append(pid)
            tid_c.append(tid)
            dev_c.append(-1)
            stream_c.append(-1)
            step_c.append(-1)
            corr_c.append(None)
            phase_c.append(None)
            bytes_c.append(None)
            src_c.append(None)
            dst_c.append(None)
        else:
            ph, step = phase_of(name)
            device = _int(pid if a is None or a.device is UNSET else a.device) \
                if cat == "gpu_user_annotation" else -1
            if device >= 0:
                ph = None  # GPU-side copies of CPU ranges: keep as user spans
            else:
                if cat != "python_function":   # Python frames enclose everything
                    host_ops += (pid, tid, start, end, op_kind(name, ph))
                if ph == "iteration":
                    iters.append((start, end, step))
                    iter_threads[(pid, tid)] = iter_threads.get((pid, tid), 0) + 1
                elif ph is not None:
                    phases.append(((pid, tid), start, end, ph))
            cat_c.append(ph or "user")
            pid_c.append(pid if device < 0 else -1)
            tid_c.append(tid if device < 0 else -1)
            dev_c.append(device)
            stream_c.append(-1)
            step_c.append(step)
            corr_c.append(None)
            phase_c.append(None)
            bytes_c.append(_comm_bytes(a) if name.startswith("record_param") else None)
            src_c.append(None)
            dst_c.append(None)
        name_c.append(name)
        start_c.append(start)
        end_c.append(end)
        at += 1
    counts["skipped"] += skipped
    rows.add_columns(len(cat_c), kind="span", rank=rank, **cols)
    for i in range(0, len(gpu_work), 2):
        launches.gpu(gpu_work[i], 0, gpu_work[i + 1])
    for i in range(0, len(calls), 4):
        launches.call(0, *calls[i:i + 4])
    for i in range(0, len(host_ops), 5):
        ops.add(*host_ops[i:i + 5])
