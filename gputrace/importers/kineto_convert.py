"""Kineto events -> trace v1 rows: a batch of decoded events at a time, a column at a time
with numpy where the values are of the usual types, event by event where one is not."""

from __future__ import annotations

from typing import Any

import numpy as np

from gputrace.importers.common import (
    Launches,
    Rows,
    is_nccl,
    memcpy_kinds,
    phase_of,
)
from gputrace.importers.host_ops import HostOps, op_kind
from gputrace.importers.kineto_groups import Groups
from gputrace.importers.kineto_json import MAX_NS, UNSET, Event, as_int, as_ns, comm_bytes

PTHREAD_MASK = 0xFFFFFFFF

_GPU = frozenset(("kernel", "gpu_memcpy", "memcpy", "gpu_memset", "memset"))
_RUNTIME = frozenset(("cuda_runtime", "cuda_driver", "runtime"))
_HOST = frozenset(("cpu_op", "user_annotation", "python_function", "operator",
                   "gpu_user_annotation"))
_COLS = ("cat", "name", "start_ns", "end_ns", "pid", "tid", "device", "stream", "step",
         "bytes", "src_kind", "dst_kind", "corr", "phase", "args")


def _convert_each(evs: list[Event], first: int, rank: int, rows: Rows, base_ns: int,
                  gpu_only: bool, threads: dict[int, int] | None, launches: Launches,
                  fixed: set[int], h2d: set[int], phases: list[tuple[Any, int, int, str]],
                  iters: list[tuple[int, int, int]], iter_threads: dict[Any, int],
                  ops: HostOps, counts: dict[str, Any], groups: Groups) -> None:
    """One batch of events as rows, event by event (a column list each, in file order),
    appended at once: what `_convert` does for a batch whose values are not all of the
    usual types, with the error of the first event that has none."""
    cols: dict[str, list[Any]] = {c: [] for c in _COLS}
    (cat_c, name_c, start_c, end_c, pid_c, tid_c, dev_c, stream_c, step_c, bytes_c, src_c,
     dst_c, corr_c, phase_c, args_c) = (cols[c] for c in _COLS)
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
        try:
            cat = cats.get(ev.cat)
            if cat is None:
                cat = cats[ev.cat] = str(ev.cat).lower()
        except TypeError:     # not hashable
            cat = str(ev.cat).lower()
        if cat not in _GPU and cat not in _RUNTIME and (gpu_only or cat not in _HOST):
            skipped += 1
            continue
        n = first + j
        name = ev.name
        if not isinstance(name, str):
            name = str(name)
        a = ev.args
        start = as_ns(ev.ts, "ts", n) + base_ns
        end = start + max(as_ns(ev.dur, "dur", n), 0)
        pid, tid = as_int(ev.pid), as_int(ev.tid)
        corr = as_int(a.correlation) if a is not None else -1
        if cat in _GPU:
            dev = as_int(pid if a is None or a.device is UNSET else a.device)
            stream = as_int(tid if a is None or a.stream is UNSET else a.stream)
            src = dst = phase = group = None
            nb = None
            if cat == "kernel":
                if is_nccl(name):
                    kind, phase, nb = "comm", "comm", comm_bytes(a)
                    group = groups.kernel(at, a)
                    fixed.add(at)
                else:
                    kind = "kernel"
            elif "memcpy" in cat:
                kind = "memcpy"
                src, dst = memcpy_kinds(name)
                b = as_int(a.nbytes) if a is not None else -1
                nb = b if b >= 0 else None
                if dst == "device" and src in ("pageable", "pinned"):
                    h2d.add(at)
            else:
                kind = "memset"
                b = as_int(a.nbytes) if a is not None else -1
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
            args_c.append(group)
            if corr >= 0:                   # no correlation (-1): not matched
                gpu_work += (at, corr)
        elif cat in _RUNTIME:
            if threads and tid & PTHREAD_MASK in threads:
                tid = threads[tid & PTHREAD_MASK]
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
            args_c.append(None)
        else:
            ph, step = phase_of(name)
            device = as_int(pid if a is None or a.device is UNSET else a.device) \
                if cat == "gpu_user_annotation" else -1
            if device >= 0:
                ph = None  # GPU-side copies of CPU ranges: keep as user spans
            else:
                if cat != "python_function":   # Python frames enclose everything
                    host_ops += (pid, tid, start, end, op_kind(name, ph), ops.code(name))
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
            bytes_c.append(comm_bytes(a) if name.startswith("record_param") else None)
            if name.startswith("record_param"):
                groups.op(a)
            src_c.append(None)
            dst_c.append(None)
            args_c.append(None)
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
    for i in range(0, len(host_ops), 6):
        ops.add(*host_ops[i:i + 6])


class _Unusual(Exception):
    """A batch with a value of an unusual type or range: converted event by event."""


_CODE = {"kernel": 1, "gpu_memcpy": 2, "memcpy": 2, "gpu_memset": 3, "memset": 3,
         "cuda_runtime": 4, "cuda_driver": 4, "runtime": 4, "cpu_op": 5,
         "user_annotation": 5, "operator": 5, "python_function": 7, "gpu_user_annotation": 6}
_NS_LIMIT = (MAX_NS - 1) // 1000      # |µs| that fits: -2**62 < µs * 1000 < 2**62


_NONE_TYPES = {int, type(None), type(UNSET)}


def _ints(vals: list[Any]) -> np.ndarray:
    """`as_int` of each value, as int64."""
    kinds = set(map(type, vals))
    if kinds <= _NONE_TYPES and kinds != {int}:    # absent: -1
        vals = [v if type(v) is int else -1 for v in vals]
        kinds = {int}
    if kinds <= {int}:
        try:
            a = np.array(vals, np.int64)
        except OverflowError:
            pass
        else:
            a[(a <= -MAX_NS) | (a >= MAX_NS)] = -1
            return a
    return np.fromiter(map(as_int, vals), np.int64, len(vals))


def _nss(vals: list[Any]) -> np.ndarray:
    """`as_ns` of each value (int64); `_Unusual` where `as_ns` would refuse one."""
    kinds = set(map(type, vals))
    if not kinds <= {int, float}:
        raise _Unusual
    out = np.empty(len(vals), np.int64)
    if kinds == {int, float}:
        f = np.array(vals, np.float64)
        # below 2**53 / 1000 µs, an int times 1000 is exact in float64: one array does
        if np.isfinite(f).all() and np.abs(f).max() < 2**53 / 1000:
            return np.rint(f * 1000).astype(np.int64)
        is_int = np.fromiter((type(v) is int for v in vals), bool, len(vals))
        at = np.flatnonzero(is_int), np.flatnonzero(~is_int)
        parts = [[vals[i] for i in at[0]], [vals[i] for i in at[1]]]
    else:
        at = (slice(None), None) if kinds == {int} else (None, slice(None))
        parts = [vals, None] if kinds == {int} else [None, vals]
    if at[0] is not None:
        try:
            a = np.array(parts[0], np.int64)
        except OverflowError:
            raise _Unusual from None
        if len(a) and (a.min() < -_NS_LIMIT or a.max() > _NS_LIMIT):
            raise _Unusual
        out[at[0]] = a * 1000
    if at[1] is not None:
        f = np.rint(np.array(parts[1], np.float64) * 1000)
        if len(f) and not (np.isfinite(f).all() and -MAX_NS < f.min() and f.max() < MAX_NS):
            raise _Unusual
        out[at[1]] = f.astype(np.int64)
    return out


def convert_batch(evs: list[Event], first: int, rank: int, rows: Rows, base_ns: int,
                  gpu_only: bool, threads: dict[int, int] | None, launches: Launches,
                  fixed: set[int], h2d: set[int], phases: list[tuple[Any, int, int, str]],
                  iters: list[tuple[int, int, int]], iter_threads: dict[Any, int],
                  ops: HostOps, counts: dict[str, Any], groups: Groups) -> None:
    """One batch of events as rows, in file order: `_convert_each`'s rows, built a column
    at a time with numpy where the values are of the usual types."""
    try:
        _convert(evs, rank, rows, base_ns, gpu_only, threads, launches, fixed, h2d, phases,
                 iters, iter_threads, ops, counts, groups)
    except _Unusual:
        _convert_each(evs, first, rank, rows, base_ns, gpu_only, threads, launches, fixed, h2d,
                      phases, iters, iter_threads, ops, counts, groups)


def _convert(evs: list[Event], rank: int, rows: Rows, base_ns: int, gpu_only: bool,
             threads: dict[int, int] | None, launches: Launches, fixed: set[int],
             h2d: set[int], phases: list[tuple[Any, int, int, str]],
             iters: list[tuple[int, int, int]], iter_threads: dict[Any, int], ops: HostOps,
             counts: dict[str, Any], groups: Groups) -> None:
    xs = [e for e in evs if e.ph == "X"]
    cats = [e.cat for e in xs]
    try:
        of = {c: _CODE.get(str(c).lower(), 0) for c in set(cats)}
    except TypeError:       # a category that is not hashable
        raise _Unusual from None
    code = np.fromiter(map(of.__getitem__, cats), np.int8, len(xs))
    if gpu_only:
        code[code >= 5] = 0
    # the values of every kept event are checked before any is used
    kept = np.flatnonzero(code)
    ev = [xs[i] for i in kept]
    code = code[kept]
    start = _nss([e.ts for e in ev]) + base_ns
    end = start + np.maximum(_nss([e.dur for e in ev]), 0)
    raw_pid = [e.pid for e in ev]
    raw_tid = [e.tid for e in ev]
    pid, tid = _ints(raw_pid), _ints(raw_tid)
    args = [e.args for e in ev]
    corr = _ints([None if a is None else a.correlation for a in args])
    names = [e.name if type(e.name) is str else str(e.name) for e in ev]
    counts["skipped"] += len(evs) - len(ev)

    gpu = np.flatnonzero((code >= 1) & (code <= 3))
    rt = np.flatnonzero(code == 4)
    hs = np.flatnonzero(code >= 5)
    sync = rt[np.fromiter(("ynchronize" in names[i] for i in rt), bool, len(rt))]
    # runtime calls: launches (every one with a correlation), rows (synchronizations)
    if threads and len(rt):
        t = tid[rt]
        mapped = np.fromiter((threads.get(v & PTHREAD_MASK, v) for v in t.tolist()),
                             np.int64, len(t))
        tid[rt] = mapped
    c = rt[corr[rt] >= 0]
    if len(c):
        launches.calls.frombytes(np.column_stack(
            (np.zeros(len(c), np.int64), corr[c], pid[c], tid[c], start[c])).tobytes())

    emit = np.zeros(len(ev), bool)
    emit[gpu] = emit[sync] = emit[hs] = True
    at = np.full(len(ev), -1, np.int64)
    at[emit] = rows.count + np.arange(int(emit.sum()))
    n = len(ev)
    cat = np.empty(n, object)
    phase = np.full(n, None, object)
    src = np.full(n, None, object)
    dst = np.full(n, None, object)
    nbytes = np.full(n, None, object)
    dev = np.full(n, -1, np.int64)
    stream = np.full(n, -1, np.int64)
    step = np.full(n, -1, np.int64)
    row_pid, row_tid = pid.copy(), tid.copy()
    corr_col = np.full(n, None, object)
    arg_col = np.full(n, None, object)

    # GPU work
    if len(gpu):
        a_dev = _ints([raw_pid[i] if args[i] is None or args[i].device is UNSET
                       else args[i].device for i in gpu])
        a_stream = _ints([raw_tid[i] if args[i] is None or args[i].stream is UNSET
                          else args[i].stream for i in gpu])
        dev[gpu], stream[gpu] = a_dev, a_stream
        row_pid[gpu] = row_tid[gpu] = -1
        g_corr = corr[gpu]
        ok = g_corr >= 0
        corr_col[gpu[ok]] = g_corr[ok].tolist()
        w = gpu[ok]
        if len(w):
            launches.work.frombytes(np.column_stack(
                (at[w], np.zeros(len(w), np.int64), corr[w])).tobytes())
        nccl: dict[str, bool] = {}
        kinds: dict[str, tuple[str | None, str | None]] = {}
        for i, k in zip(gpu.tolist(), code[gpu].tolist(), strict=True):
            name = names[i]
            if k == 1:
                is_comm = nccl.get(name)
                if is_comm is None:
                    is_comm = nccl[name] = is_nccl(name)
                if is_comm:
                    cat[i], phase[i], nbytes[i] = "comm", "comm", comm_bytes(args[i])
                    arg_col[i] = groups.kernel(int(at[i]), args[i])
                    fixed.add(int(at[i]))
                else:
                    cat[i] = "kernel"
                continue
            a = args[i]
            b = as_int(a.nbytes) if a is not None else -1
            nbytes[i] = b if b >= 0 else None
            if k == 2:
                cat[i] = "memcpy"
                sd = kinds.get(name)
                if sd is None:
                    sd = kinds[name] = memcpy_kinds(name)
                src[i], dst[i] = sd
                if sd[1] == "device" and sd[0] in ("pageable", "pinned"):
                    h2d.add(int(at[i]))
            else:
                cat[i] = "memset"
    cat[sync] = "sync"
    dev[sync] = -1

    # host ranges
    if len(hs):
        seen: dict[str, tuple[str | None, int, int]] = {}
        op_rows: list[int] = []
        op_kinds: list[int] = []
        on_gpu = hs[code[hs] == 6]
        if len(on_gpu):
            dev[on_gpu] = _ints([raw_pid[i] if args[i] is None or args[i].device is UNSET
                                 else args[i].device for i in on_gpu])
        for i in hs.tolist():
            name = names[i]
            ps = seen.get(name)
            if ps is None:
                ph, st = phase_of(name)
                ps = seen[name] = ph, st, op_kind(name, ph)
            ph, step[i], kind = ps
            if dev[i] >= 0:
                ph = None   # GPU-side copies of CPU ranges: keep as user spans
                row_pid[i] = row_tid[i] = -1
            else:
                if code[i] != 7:    # Python frames enclose everything
                    op_rows.append(i)
                    op_kinds.append(kind)
                if ph == "iteration":
                    iters.append((int(start[i]), int(end[i]), ps[1]))
                    key = (int(pid[i]), int(tid[i]))
                    iter_threads[key] = iter_threads.get(key, 0) + 1
                elif ph is not None:
                    phases.append(((int(pid[i]), int(tid[i])), int(start[i]), int(end[i]),
                                   ph))
            cat[i] = ph or "user"
            if name.startswith("record_param"):
                nbytes[i] = comm_bytes(args[i])
                groups.op(args[i])
        if op_rows:
            o = np.array(op_rows, np.int64)
            ops.data.frombytes(np.column_stack(
                (pid[o], tid[o], start[o], end[o], np.array(op_kinds, np.int64),
                 np.array([ops.code(names[i]) for i in op_rows], np.int64))).tobytes())

    e = np.flatnonzero(emit)
    rows.add_columns(len(e), kind="span", rank=rank, cat=cat[e].tolist(),
                     name=[names[i] for i in e.tolist()], start_ns=start[e], end_ns=end[e],
                     pid=row_pid[e], tid=row_tid[e], device=dev[e], stream=stream[e],
                     step=step[e], bytes=nbytes[e].tolist(), src_kind=src[e].tolist(),
                     dst_kind=dst[e].tolist(), corr=corr_col[e].tolist(),
                     phase=phase[e].tolist(), args=arg_col[e].tolist())
