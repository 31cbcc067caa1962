"""Kineto (PyTorch profiler) / Chrome trace JSON -> trace v1 rows, streamed with ijson."""

from __future__ import annotations

import gzip
import math
import os
import re
from collections.abc import Sequence
from typing import IO, Any

import ijson

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


def _open(path: str) -> IO[bytes]:
    with open(path, "rb") as f:
        gz = f.read(2) == b"\x1f\x8b"
    return gzip.open(path, "rb") if gz else open(path, "rb")


def _top_level(path: str, key: str) -> Any:
    """One top-level value, without building the events list."""
    try:
        with _open(path) as f:
            for v in ijson.items(f, key, use_float=True):
                return v
    except ijson.JSONError as e:
        raise ImportFailed(f"not valid JSON: {str(e).splitlines()[0][:120]}") from None
    except (EOFError, gzip.BadGzipFile) as e:
        raise ImportFailed(f"cannot decompress: {e}") from None
    return None


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


def _comm_bytes(args: dict[str, Any]) -> int | None:
    for key in ("In msg nelems", "Out msg nelems"):
        n = args.get(key)
        if isinstance(n, int) and n >= 0:
            size = _DTYPE_BYTES.get(str(args.get("dtype", "")).lower())
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
    try:
        base = _top_level(path, "baseTimeNanoseconds")
        base_ns = _int(base) if base is not None else 0
        if base_ns < 0:
            raise ImportFailed(f"baseTimeNanoseconds = {base!r} is not a time in ns")
        with _open(path) as f:
            for n, ev in enumerate(ijson.items(f, "traceEvents.item", use_float=True)):
                counts["events"] += 1
                if not isinstance(ev, dict):
                    raise ImportFailed(f"event {n} is {type(ev).__name__}, not an object")
                if ev.get("ph") != "X":
                    counts["skipped"] += 1
                    continue
                cat = str(ev.get("cat", "")).lower()
                name = ev.get("name")
                if not isinstance(name, str):
                    name = str(name)
                args = ev.get("args")
                if not isinstance(args, dict):
                    args = {}
                start = _ns(ev.get("ts"), "ts", n) + base_ns
                end = start + max(_ns(ev.get("dur", 0), "dur", n), 0)
                pid, tid = _int(ev.get("pid")), _int(ev.get("tid"))
                corr = _int(args.get("correlation"))
                if cat in ("kernel", "gpu_memcpy", "memcpy", "gpu_memset", "memset"):
                    dev = _int(args.get("device", pid))
                    common = dict(rank=rank, pid=-1, tid=-1, device=dev,
                                  stream=_int(args.get("stream", tid)),
                                  corr=corr if corr >= 0 else None)
                    if cat == "kernel":
                        if is_nccl(name):
                            i = rows.add("span", "comm", name, start, end, phase="comm",
                                         bytes=_comm_bytes(args), **common)
                            fixed.add(i)
                        else:
                            i = rows.add("span", "kernel", name, start, end, **common)
                    elif "memcpy" in cat:
                        src, dst = memcpy_kinds(name)
                        nb = _int(args.get("bytes"))
                        i = rows.add("span", "memcpy", name, start, end, src_kind=src,
                                     dst_kind=dst, bytes=nb if nb >= 0 else None, **common)
                        if dst == "device" and src in ("pageable", "pinned"):
                            h2d.add(i)
                    else:
                        nb = _int(args.get("bytes"))
                        i = rows.add("span", "memset", name, start, end,
                                     bytes=nb if nb >= 0 else None, **common)
                    launches.gpu(i, 0, corr)           # no correlation (-1): not matched
                elif cat in ("cuda_runtime", "cuda_driver", "runtime"):
                    if threads and tid & _PTHREAD_MASK in threads:
                        tid = threads[tid & _PTHREAD_MASK]
                    launches.call(0, corr, pid, tid, start)
                    if "ynchronize" in name:
                        rows.add("span", "sync", name, start, end, rank=rank, pid=pid, tid=tid)
                elif cat in ("cpu_op", "user_annotation", "python_function", "operator",
                             "gpu_user_annotation") and not gpu_only:
                    ph, step = phase_of(name)
                    device = _int(args.get("device", pid)) if cat == "gpu_user_annotation" \
                        else -1
                    if device >= 0:
                        ph = None  # GPU-side copies of CPU ranges: keep as user spans
                    else:
                        if cat != "python_function":   # Python frames enclose everything
                            ops.add(pid, tid, start, end, op_kind(name, ph))
                        if ph == "iteration":
                            iters.append((start, end, step))
                            iter_threads[(pid, tid)] = iter_threads.get((pid, tid), 0) + 1
                        elif ph is not None:
                            phases.append(((pid, tid), start, end, ph))
                    rows.add("span", ph or "user", name, start, end, rank=rank,
                             pid=pid if device < 0 else -1, tid=tid if device < 0 else -1,
                             device=device, step=step,
                             bytes=_comm_bytes(args) if name.startswith("record_param") else None)
                else:
                    counts["skipped"] += 1
    except ijson.JSONError as e:
        raise ImportFailed(f"not valid JSON: {str(e).splitlines()[0][:120]}") from None
    except (EOFError, gzip.BadGzipFile, OSError) as e:
        if isinstance(e, FileNotFoundError | PermissionError):
            raise
        raise ImportFailed(f"cannot decompress or read: {e}") from None
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
