"""Nsight Systems SQLite export (`nsys export --type sqlite`) -> trace v1 rows."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pyarrow as pa

from gputrace.importers import kernel_steps
from gputrace.importers.common import (
    ImportFailed,
    Launches,
    Rows,
    attribute_launches,
    is_nccl,
    loop_threads,
    phase_of,
)
from gputrace.importers.nsys_db import Db, as_int, batches, ids, ints, need, smalls
from gputrace.importers.nsys_metrics import gpu_metrics, nic_metrics
from gputrace.importers.nvtx_names import convention_phase, emit_nvtx
from gputrace.importers.nvtx_ops import NvtxOps

SUPPORTED_MAJOR = 3
_MEM_KIND = {0: "pageable", 1: "pinned", 2: "device", 4: "managed", 5: "device", 6: "managed"}
_COPY = {1: "HtoD", 2: "DtoH", 3: "HtoA", 4: "AtoH", 5: "AtoA", 6: "AtoD", 7: "DtoA",
         8: "DtoD", 9: "HtoH", 10: "PtoP", 11: "HtoD", 12: "DtoH", 13: "DtoD"}
_NVTX_RANGES = (59, 60)      # NvtxPushPopRange, NvtxStartEndRange
_NVTX_MARK = 34
_NVTX_DOMAIN = 75


def _pid(global_id: int) -> int:
    return (int(global_id) >> 24) & 0xFFFFFF


def _tid(global_tid: int) -> int:
    return int(global_tid) & 0xFFFFFF


def _ranks(pid: np.ndarray, rank_of: dict[int, int]) -> np.ndarray:
    rank = np.full(len(pid), -1, np.int64)
    for p, r in rank_of.items():
        rank[pid == p] = r
    return rank


def _gpu_work(rows: Rows, launches: Launches, pid: np.ndarray, corr: list[Any]) -> np.ndarray:
    """The row indices the next len(pid) rows take; their launches noted (by scope pid)."""
    at = rows.count + np.arange(len(pid), dtype=np.int64)
    known = np.fromiter((type(c) is int and 0 <= c < 2**63 for c in corr), bool, len(corr))
    if known.any():
        c = np.array([c for c, k in zip(corr, known.tolist(), strict=True) if k], np.int64)
        launches.work.frombytes(np.column_stack((at[known], pid[known], c)).tobytes())
    return at


def read(path: str, rows: Rows) -> dict[str, Any]:
    db = Db(path)
    if "META_DATA_EXPORT" not in db.tables:
        raise ImportFailed("no META_DATA_EXPORT table: not an Nsight Systems SQLite export")
    meta = dict(db.rows("SELECT name, value FROM META_DATA_EXPORT"))
    version = str(meta.get("EXPORT_SCHEMA_VERSION", ""))
    try:
        major = int(version.split(".")[0])
    except ValueError:
        raise ImportFailed(f"unreadable export schema version {version!r}") from None
    if major != SUPPORTED_MAJOR:
        raise ImportFailed(f"Nsight Systems export schema {version} is not supported "
                           f"(this gputrace reads {SUPPORTED_MAJOR}.x)")
    offset = 0
    if "TARGET_INFO_SESSION_START_TIME" in db.tables:
        for utc, clock in db.rows(
                "SELECT utcEpochNs, systemClockNs FROM TARGET_INFO_SESSION_START_TIME"):
            offset = as_int(utc, "utcEpochNs") - as_int(clock, "systemClockNs")
    strings: dict[int, str] = {}
    if "StringIds" in db.tables:
        strings = {i: str(v) for i, v in db.rows("SELECT id, value FROM StringIds")}

    # ranks: one per process that ran GPU work, in the order of its lowest GPU
    gpu_tables = [t for t in ("CUPTI_ACTIVITY_KIND_KERNEL", "CUPTI_ACTIVITY_KIND_MEMCPY",
                              "CUPTI_ACTIVITY_KIND_MEMSET") if t in db.tables]
    dev_of: dict[int, int] = {}
    for t in gpu_tables:
        need(db, t, {"globalPid", "deviceId"})
        for gp, dev in db.rows(f"SELECT globalPid, MIN(deviceId) FROM {t} GROUP BY globalPid"):
            p = _pid(as_int(gp, "globalPid"))
            dev = as_int(dev, f"{t}.deviceId")
            dev_of[p] = min(dev_of.get(p, dev), dev)
    rank_of = {p: r for r, p in enumerate(sorted(dev_of, key=lambda p: (dev_of[p], p)))}
    counts: dict[str, int] = {}

    # NVTX: phases, iterations, the user's own ranges
    domains: dict[int, str] = {}
    phases: list[tuple[Any, int, int, str]] = []
    iters: list[tuple[int, int, int]] = []
    iter_threads: dict[Any, int] = {}
    ops = NvtxOps()
    repeats: dict[int, dict[str, Any]] = {}
    if need(db, "NVTX_EVENTS", {"start", "end", "eventType", "text", "textId", "globalTid",
                                 "domainId"}):
        for dom, text in db.rows(f"SELECT domainId, text FROM NVTX_EVENTS "
                                 f"WHERE eventType = {_NVTX_DOMAIN}"):
            domains[dom] = str(text)
        n = 0
        seen: dict[str, tuple[str | None, int]] = {}
        for s, e, et, text, tid_, gtid, dom in batches(
                db, "SELECT start, end, eventType, text, textId, globalTid, domainId "
                f"FROM NVTX_EVENTS WHERE eventType IN ({_NVTX_RANGES[0]}, {_NVTX_RANGES[1]}, "
                f"{_NVTX_MARK}) ORDER BY start"):
            m = len(s)
            names = [str(t) if t is not None else str(strings.get(i, ""))
                     for t, i in zip(text, tid_, strict=True)]
            g = ids(gtid, "NVTX globalTid")
            pid, tid = (g >> 24) & 0xFFFFFF, g & 0xFFFFFF
            start = ints(s, "NVTX start") + offset
            mark = np.array([t == _NVTX_MARK for t in et], bool)
            has_end = np.array([v is not None for v in e], bool) & ~mark
            end = np.zeros(m, np.int64)
            if has_end.any():
                end[has_end] = ints([v for v, h in zip(e, has_end.tolist(), strict=True)
                                      if h], "NVTX end") + offset
            rank = _ranks(pid, rank_of)
            kind, cat, step, args = [], [], np.full(m, -1, np.int64), []
            for k in range(m):
                if mark[k]:
                    kind.append("instant")
                    cat.append("user")
                    args.append(None)
                    continue
                n += 1
                base, seq = emit_nvtx(names[k])
                ps = seen.get(base)
                if ps is None:
                    ps = phase_of(base)
                    ps = seen[base] = ps if ps[0] is not None else (convention_phase(base), -1)
                ph, step[k] = ps
                if has_end[k]:
                    key = (int(pid[k]), int(tid[k]))
                    ph = ops.add(key, int(start[k]), int(end[k]), base, ph, seq)
                kind.append("span")
                cat.append(ph or "user")
                dom_ = dom[k]
                args.append(json.dumps({"domain": domains[dom_]}) if dom_ and
                            domains.get(dom_) and domains[dom_] != "gputrace" else None)
                if has_end[k] and ph is not None:
                    st, en, key = int(start[k]), int(end[k]), (int(pid[k]), int(tid[k]))
                    if ph == "iteration":
                        iters.append((st, en, ps[1] if ps[1] >= 0 else len(iters)))
                        iter_threads[key] = iter_threads.get(key, 0) + 1
                    else:
                        phases.append((key, st, en, ph))
            rows.add_columns(m, kind=kind, cat=cat, name=names, start_ns=start,
                             end_ns=pa.array(end, mask=~has_end), rank=rank, pid=pid, tid=tid,
                             step=step, args=args)
        counts["nvtx_ranges"] = n
        counts["emit_nvtx_ops"] = ops.seq_ops
        for key, rep in ops.repeats(set(iter_threads)).items():
            for k, (st, en) in enumerate(zip(rep.start.tolist(), rep.end.tolist(),
                                             strict=True)):
                iters.append((st, en, k))
            iter_threads[key] = len(rep.start)
            rows.add_columns(len(rep.start), kind="span", cat="iteration",
                             name=f"iteration (repeat of {rep.anchor})",
                             start_ns=rep.start, end_ns=rep.end,
                             rank=_ranks(np.full(len(rep.start), key[0]), rank_of),
                             pid=key[0], tid=key[1], step=np.arange(len(rep.start)))
            repeats[key[0]] = {"anchor": rep.anchor, "count": len(rep.start),
                               "period_ms": round(rep.period_ns / 1e6, 3)}

    launches = Launches()
    if need(db, "CUPTI_ACTIVITY_KIND_RUNTIME", {"start", "globalTid", "correlationId"}):
        for s, gtid, corr in batches(
                db, "SELECT start, globalTid, correlationId FROM CUPTI_ACTIVITY_KIND_RUNTIME"):
            g = ids(gtid, "runtime globalTid")
            pid = (g >> 24) & 0xFFFFFF
            start = ints(s, "runtime start") + offset
            known = np.fromiter((type(c) is int and 0 <= c < 2**63 for c in corr), bool,
                                len(corr))
            if known.any():
                c = np.array([c for c, k in zip(corr, known.tolist(), strict=True) if k],
                             np.int64)
                launches.calls.frombytes(np.column_stack(
                    (pid[known], c, pid[known], (g & 0xFFFFFF)[known], start[known])).tobytes())

    fixed: set[int] = set()
    h2d: set[int] = set()
    kcols = {"start", "end", "deviceId", "streamId", "correlationId", "globalPid",
             "demangledName", "shortName"}
    kfirst = rows.count
    if need(db, "CUPTI_ACTIVITY_KIND_KERNEL", kcols):
        n = 0
        named: dict[tuple[Any, Any], tuple[str, bool]] = {}
        for s, e, dev, stream, corr, gp, dname, sname in batches(
                db, "SELECT start, end, deviceId, streamId, correlationId, globalPid, "
                "demangledName, shortName FROM CUPTI_ACTIVITY_KIND_KERNEL ORDER BY start"):
            m = len(s)
            names, comm = [], np.zeros(m, bool)
            for k, key in enumerate(zip(dname, sname, strict=True)):
                nc = named.get(key)
                if nc is None:
                    short = strings.get(key[1], "")
                    name = strings.get(key[0], short)
                    nc = named[key] = name, is_nccl(short) or is_nccl(name)
                names.append(nc[0])
                comm[k] = nc[1]
            pid = (ids(gp, "kernel globalPid") >> 24) & 0xFFFFFF
            start = ints(s, "kernel start") + offset
            end = ints(e, "kernel end") + offset
            at = _gpu_work(rows, launches, pid, corr)
            fixed.update(at[comm].tolist())
            rows.add_columns(m, kind="span", cat=np.where(comm, "comm", "kernel").tolist(),
                             name=names, start_ns=start, end_ns=end, rank=_ranks(pid, rank_of),
                             pid=pid, device=smalls(dev), stream=smalls(stream), corr=corr,
                             phase=np.where(comm, "comm", None).tolist())
            n += m
        counts["kernels"] = n
    mcols = {"start", "end", "deviceId", "streamId", "correlationId", "globalPid", "bytes",
             "copyKind", "srcKind", "dstKind"}
    if need(db, "CUPTI_ACTIVITY_KIND_MEMCPY", mcols):
        n = 0
        peer = {"srcDeviceId", "dstDeviceId"} <= db.columns("CUPTI_ACTIVITY_KIND_MEMCPY")
        extra = ", srcDeviceId, dstDeviceId" if peer else ", NULL, NULL"
        for s, e, dev, stream, corr, gp, nb, kind, sk, dk, sd, dd in batches(
                db, "SELECT start, end, deviceId, streamId, correlationId, globalPid, bytes, "
                f"copyKind, srcKind, dstKind{extra} FROM CUPTI_ACTIVITY_KIND_MEMCPY "
                "ORDER BY start"):
            m = len(s)
            args = [None if a is None and b is None else
                    json.dumps({"src_device": int(a if a is not None else -1),
                                "dst_device": int(b if b is not None else -1)})
                    for a, b in zip(sd, dd, strict=True)]
            src = [_MEM_KIND.get(k) for k in sk]
            dst = [_MEM_KIND.get(k) for k in dk]
            pid = (ids(gp, "memcpy globalPid") >> 24) & 0xFFFFFF
            start = ints(s, "memcpy start") + offset
            end = ints(e, "memcpy end") + offset
            at = _gpu_work(rows, launches, pid, corr)
            h2d.update(int(at[k]) for k in range(m)
                       if dst[k] == "device" and src[k] in ("pageable", "pinned"))
            rows.add_columns(m, kind="span", cat="memcpy",
                             name=[f"Memcpy {_COPY.get(k, 'unknown')}" for k in kind],
                             start_ns=start, end_ns=end, rank=_ranks(pid, rank_of), pid=pid,
                             device=smalls(dev), stream=smalls(stream), corr=corr, bytes=nb,
                             src_kind=src, dst_kind=dst, args=args)
            n += m
        counts["memcpy"] = n
    if need(db, "CUPTI_ACTIVITY_KIND_MEMSET", {"start", "end", "deviceId", "streamId",
                                                "correlationId", "globalPid", "bytes"}):
        n = 0
        for s, e, dev, stream, corr, gp, nb in batches(
                db, "SELECT start, end, deviceId, streamId, correlationId, globalPid, bytes "
                "FROM CUPTI_ACTIVITY_KIND_MEMSET ORDER BY start"):
            pid = (ids(gp, "memset globalPid") >> 24) & 0xFFFFFF
            start = ints(s, "memset start") + offset
            end = ints(e, "memset end") + offset
            _gpu_work(rows, launches, pid, corr)
            rows.add_columns(len(s), kind="span", cat="memset", name="Memset", start_ns=start,
                             end_ns=end, rank=_ranks(pid, rank_of), pid=pid,
                             device=smalls(dev), stream=smalls(stream), corr=corr, bytes=nb)
            n += len(s)
        counts["memset"] = n
    if need(db, "CUPTI_ACTIVITY_KIND_SYNCHRONIZATION", {"start", "end", "deviceId",
                                                         "streamId", "globalPid"}):
        for s, e, dev, stream, gp in batches(
                db, "SELECT start, end, deviceId, streamId, globalPid "
                "FROM CUPTI_ACTIVITY_KIND_SYNCHRONIZATION"):
            pid = (ids(gp, "sync globalPid") >> 24) & 0xFFFFFF
            rows.add_columns(len(s), kind="span", cat="sync", name="synchronize",
                             start_ns=ints(s, "sync start") + offset,
                             end_ns=ints(e, "sync end") + offset, rank=_ranks(pid, rank_of),
                             pid=pid, device=smalls(dev), stream=smalls(stream))
    # no iteration mark and no host ranges that repeat: where the kernel sequence repeats
    marked = {k[0] for k in iter_threads}
    by_kernels = kernel_steps.add(rows, kernel_steps.find(
        rows, kfirst, {r for p, r in rank_of.items() if p not in marked}))
    attribute_launches(rows, phases, iters, launches, fixed, loop_threads(phases, iter_threads),
                       h2d)
    counts["gpu_metrics"] = gpu_metrics(db, rows, offset)
    counts["nic_metrics"] = nic_metrics(db, rows, offset)
    return {"counts": counts, "schema_version": version,
            "inferred_iterations": {str(rank_of[p]): v for p, v in repeats.items()
                                    if p in rank_of} | by_kernels,
            "product": meta.get("EXPORT_PRODUCT_VERSION"), "ranks_by_gpu": {
                str(r): {"pid": p, "first_gpu": dev_of[p]} for p, r in rank_of.items()}}
