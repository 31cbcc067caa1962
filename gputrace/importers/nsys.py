"""Nsight Systems SQLite export (`nsys export --type sqlite`) -> trace v1 rows."""

from __future__ import annotations

import json
import re
import sqlite3
from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa

from gputrace.importers.common import (
    ImportFailed,
    Launches,
    Rows,
    attribute_launches,
    is_nccl,
    loop_threads,
    phase_of,
)

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


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", text.lower()).strip("_")


class _Db:
    def __init__(self, path: str) -> None:
        try:
            self.c = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
            self.tables = {r[0] for r in self.c.execute(
                "SELECT name FROM sqlite_master WHERE type='table'")}
        except sqlite3.DatabaseError as e:
            raise ImportFailed(f"not an SQLite database ({e})") from None

    def columns(self, table: str) -> set[str]:
        return {r[1] for r in self.c.execute(f"PRAGMA table_info({table})")}

    def rows(self, sql: str, *params: Any) -> Any:
        try:
            yield from self.c.execute(sql, params)
        except sqlite3.DatabaseError as e:
            raise ImportFailed(f"unreadable Nsight Systems table ({e})") from None


def _need(db: _Db, table: str, cols: set[str]) -> bool:
    if table not in db.tables:
        return False
    missing = cols - db.columns(table)
    if missing:
        raise ImportFailed(f"table {table} lacks column(s) {', '.join(sorted(missing))}; "
                           "an unsupported Nsight Systems export")
    return True


def _small(v: Any) -> int:
    """A device or stream id; unset ones are stored as 0xFFFFFFFF or NULL."""
    return v if isinstance(v, int) and 0 <= v < 2**15 else -1


def _int(v: Any, what: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ImportFailed(f"{what} is {v!r}, not an integer")
    return v


_BATCH = 1 << 16


def _batches(db: _Db, sql: str) -> Iterator[list[Any]]:
    """The rows of a query as columns (a list each), 65536 rows at a time."""
    try:
        cur = db.c.execute(sql)
        while batch := cur.fetchmany(_BATCH):
            yield [list(c) for c in zip(*batch, strict=True)]
    except sqlite3.DatabaseError as e:
        raise ImportFailed(f"unreadable Nsight Systems table ({e})") from None


def _ints(vals: list[Any], what: str) -> np.ndarray:
    """`_int` of each value, as int64: the first that is not an integer is refused."""
    if set(map(type, vals)) <= {int}:
        try:
            return np.array(vals, np.int64)
        except OverflowError:
            pass
    for v in vals:
        if type(v) is not int or not -2**63 <= v < 2**63:
            _int(v, what)
            raise ImportFailed(f"{what} is {v!r}, out of range")
    return np.array(vals, np.int64)


def _smalls(vals: list[Any]) -> np.ndarray:
    """`_small` of each value, as int64."""
    if set(map(type, vals)) <= {int}:
        try:
            a = np.array(vals, np.int64)
        except OverflowError:
            pass
        else:
            a[(a < 0) | (a >= 2**15)] = -1
            return a
    return np.fromiter(map(_small, vals), np.int64, len(vals))


def _ids(vals: list[Any], what: str) -> np.ndarray:
    """Global process or thread ids (NULL: 0) as int64."""
    return _ints([0 if v is None else v for v in vals], what)


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
    db = _Db(path)
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
            offset = _int(utc, "utcEpochNs") - _int(clock, "systemClockNs")
    strings: dict[int, str] = {}
    if "StringIds" in db.tables:
        strings = {i: str(v) for i, v in db.rows("SELECT id, value FROM StringIds")}

    # ranks: one per process that ran GPU work, in the order of its lowest GPU
    gpu_tables = [t for t in ("CUPTI_ACTIVITY_KIND_KERNEL", "CUPTI_ACTIVITY_KIND_MEMCPY",
                              "CUPTI_ACTIVITY_KIND_MEMSET") if t in db.tables]
    dev_of: dict[int, int] = {}
    for t in gpu_tables:
        _need(db, t, {"globalPid", "deviceId"})
        for gp, dev in db.rows(f"SELECT globalPid, MIN(deviceId) FROM {t} GROUP BY globalPid"):
            p = _pid(_int(gp, "globalPid"))
            dev = _int(dev, f"{t}.deviceId")
            dev_of[p] = min(dev_of.get(p, dev), dev)
    rank_of = {p: r for r, p in enumerate(sorted(dev_of, key=lambda p: (dev_of[p], p)))}
    counts: dict[str, int] = {}

    # NVTX: phases, iterations, the user's own ranges
    domains: dict[int, str] = {}
    phases: list[tuple[Any, int, int, str]] = []
    iters: list[tuple[int, int, int]] = []
    iter_threads: dict[Any, int] = {}
    if _need(db, "NVTX_EVENTS", {"start", "end", "eventType", "text", "textId", "globalTid",
                                 "domainId"}):
        for dom, text in db.rows(f"SELECT domainId, text FROM NVTX_EVENTS "
                                 f"WHERE eventType = {_NVTX_DOMAIN}"):
            domains[dom] = str(text)
        n = 0
        seen: dict[str, tuple[str | None, int]] = {}
        for s, e, et, text, tid_, gtid, dom in _batches(
                db, "SELECT start, end, eventType, text, textId, globalTid, domainId "
                f"FROM NVTX_EVENTS WHERE eventType IN ({_NVTX_RANGES[0]}, {_NVTX_RANGES[1]}, "
                f"{_NVTX_MARK}) ORDER BY start"):
            m = len(s)
            names = [str(t) if t is not None else str(strings.get(i, ""))
                     for t, i in zip(text, tid_, strict=True)]
            g = _ids(gtid, "NVTX globalTid")
            pid, tid = (g >> 24) & 0xFFFFFF, g & 0xFFFFFF
            start = _ints(s, "NVTX start") + offset
            mark = np.array([t == _NVTX_MARK for t in et], bool)
            has_end = np.array([v is not None for v in e], bool) & ~mark
            end = np.zeros(m, np.int64)
            if has_end.any():
                end[has_end] = _ints([v for v, h in zip(e, has_end.tolist(), strict=True)
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
                ps = seen.get(names[k])
                if ps is None:
                    ps = seen[names[k]] = phase_of(names[k])
                ph, step[k] = ps
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

    launches = Launches()
    if _need(db, "CUPTI_ACTIVITY_KIND_RUNTIME", {"start", "globalTid", "correlationId"}):
        for s, gtid, corr in _batches(
                db, "SELECT start, globalTid, correlationId FROM CUPTI_ACTIVITY_KIND_RUNTIME"):
            g = _ids(gtid, "runtime globalTid")
            pid = (g >> 24) & 0xFFFFFF
            start = _ints(s, "runtime start") + offset
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
    if _need(db, "CUPTI_ACTIVITY_KIND_KERNEL", kcols):
        n = 0
        named: dict[tuple[Any, Any], tuple[str, bool]] = {}
        for s, e, dev, stream, corr, gp, dname, sname in _batches(
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
            pid = (_ids(gp, "kernel globalPid") >> 24) & 0xFFFFFF
            start = _ints(s, "kernel start") + offset
            end = _ints(e, "kernel end") + offset
            at = _gpu_work(rows, launches, pid, corr)
            fixed.update(at[comm].tolist())
            rows.add_columns(m, kind="span", cat=np.where(comm, "comm", "kernel").tolist(),
                             name=names, start_ns=start, end_ns=end, rank=_ranks(pid, rank_of),
                             pid=pid, device=_smalls(dev), stream=_smalls(stream), corr=corr,
                             phase=np.where(comm, "comm", None).tolist())
            n += m
        counts["kernels"] = n
    mcols = {"start", "end", "deviceId", "streamId", "correlationId", "globalPid", "bytes",
             "copyKind", "srcKind", "dstKind"}
    if _need(db, "CUPTI_ACTIVITY_KIND_MEMCPY", mcols):
        n = 0
        peer = {"srcDeviceId", "dstDeviceId"} <= db.columns("CUPTI_ACTIVITY_KIND_MEMCPY")
        extra = ", srcDeviceId, dstDeviceId" if peer else ", NULL, NULL"
        for s, e, dev, stream, corr, gp, nb, kind, sk, dk, sd, dd in _batches(
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
            pid = (_ids(gp, "memcpy globalPid") >> 24) & 0xFFFFFF
            start = _ints(s, "memcpy start") + offset
            end = _ints(e, "memcpy end") + offset
            at = _gpu_work(rows, launches, pid, corr)
            h2d.update(int(at[k]) for k in range(m)
                       if dst[k] == "device" and src[k] in ("pageable", "pinned"))
            rows.add_columns(m, kind="span", cat="memcpy",
                             name=[f"Memcpy {_COPY.get(k, 'unknown')}" for k in kind],
                             start_ns=start, end_ns=end, rank=_ranks(pid, rank_of), pid=pid,
                             device=_smalls(dev), stream=_smalls(stream), corr=corr, bytes=nb,
                             src_kind=src, dst_kind=dst, args=args)
            n += m
        counts["memcpy"] = n
    if _need(db, "CUPTI_ACTIVITY_KIND_MEMSET", {"start", "end", "deviceId", "streamId",
                                                "correlationId", "globalPid", "bytes"}):
        n = 0
        for s, e, dev, stream, corr, gp, nb in _batches(
                db, "SELECT start, end, deviceId, streamId, correlationId, globalPid, bytes "
                "FROM CUPTI_ACTIVITY_KIND_MEMSET ORDER BY start"):
            pid = (_ids(gp, "memset globalPid") >> 24) & 0xFFFFFF
            start = _ints(s, "memset start") + offset
            end = _ints(e, "memset end") + offset
            _gpu_work(rows, launches, pid, corr)
            rows.add_columns(len(s), kind="span", cat="memset", name="Memset", start_ns=start,
                             end_ns=end, rank=_ranks(pid, rank_of), pid=pid,
                             device=_smalls(dev), stream=_smalls(stream), corr=corr, bytes=nb)
            n += len(s)
        counts["memset"] = n
    if _need(db, "CUPTI_ACTIVITY_KIND_SYNCHRONIZATION", {"start", "end", "deviceId",
                                                         "streamId", "globalPid"}):
        for s, e, dev, stream, gp in _batches(
                db, "SELECT start, end, deviceId, streamId, globalPid "
                "FROM CUPTI_ACTIVITY_KIND_SYNCHRONIZATION"):
            pid = (_ids(gp, "sync globalPid") >> 24) & 0xFFFFFF
            rows.add_columns(len(s), kind="span", cat="sync", name="synchronize",
                             start_ns=_ints(s, "sync start") + offset,
                             end_ns=_ints(e, "sync end") + offset, rank=_ranks(pid, rank_of),
                             pid=pid, device=_smalls(dev), stream=_smalls(stream))
    attribute_launches(rows, phases, iters, launches, fixed, loop_threads(phases, iter_threads),
                       h2d)
    counts["gpu_metrics"] = _gpu_metrics(db, rows, offset)
    counts["nic_metrics"] = _nic_metrics(db, rows, offset)
    return {"counts": counts, "schema_version": version,
            "product": meta.get("EXPORT_PRODUCT_VERSION"), "ranks_by_gpu": {
                str(r): {"pid": p, "first_gpu": dev_of[p]} for p, r in rank_of.items()}}


def _gpu_metrics(db: _Db, rows: Rows, offset: int) -> int:
    """GPU_METRICS samples (`nsys --gpu-metrics-devices`), named `gpu.metric.<name>`."""
    if not _need(db, "GPU_METRICS", {"timestamp", "typeId", "metricId", "value"}):
        return 0
    names: dict[tuple[int, int], str] = {}
    if _need(db, "TARGET_INFO_GPU_METRICS", {"typeId", "metricId", "metricName"}):
        names = {(t, m): str(n) for t, m, n in db.rows(
            "SELECT typeId, metricId, metricName FROM TARGET_INFO_GPU_METRICS")}
    types = sorted({t for t, _ in names}) or []
    n = 0
    for ts, typ, mid, value in db.rows(
            "SELECT timestamp, typeId, metricId, value FROM GPU_METRICS ORDER BY timestamp"):
        name = names.get((typ, mid), f"metric{mid}")
        unit = "%" if ("%" in name or "Utilization" in name or "Throughput" in name) else ""
        rows.add("sample", "gpu", f"gpu.metric.{_slug(name)}", _int(ts, "timestamp") + offset,
                 value=float(value) if isinstance(value, int | float) else None,
                 unit=unit, device=types.index(typ) if typ in types else -1)
        n += 1
    return n


# NIC metric name (after an "IB: " prefix) -> the name gputrace's own collectors give the
# cumulative counter: InfiniBand ports as the sysfs collector, Ethernet as psutil's
_IB_COUNTERS = {"bytes sent": "xmit_bytes", "bytes received": "rcv_bytes",
                "packets sent": "xmit_packets", "packets received": "rcv_packets"}
_NET_COUNTERS = {"bytes sent": "sent_bytes", "bytes received": "recv_bytes"}
_TIME = {"s": 1e9, "sec": 1e9, "ms": 1e6, "us": 1e3, "ns": 1.0}
_SIZE = {"b": 1.0, "byte": 1.0, "bytes": 1.0, "kb": 1e3, "mb": 1e6, "gb": 1e9,
         "kib": 1024.0, "mib": 1024.0**2, "gib": 1024.0**3, "bit": 1 / 8, "bits": 1 / 8,
         "kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8, "packets": 1.0, "": 1.0}


def _amount(value: float, unit: str, dur_ns: int) -> float:
    """What a sample moved in its interval: an amount as it is, a rate (`B/s`, `Gbit/s`,
    `bytes per ms`) times the interval."""
    u = unit.strip().lower().replace(" per ", "/").replace(" ", "")
    if "/" not in u:
        return value * _SIZE.get(u, 1.0)
    size, per = u.rsplit("/", 1)
    return value * _SIZE.get(size, 1.0) * dur_ns / _TIME.get(per, 1e9)


def _nic_metrics(db: _Db, rows: Rows, offset: int) -> int:
    """NET_NIC_METRIC (`nsys --nic-metrics`): per NIC port, bytes and packets sent and
    received become cumulative counters like gputrace's own (`ib.<nic>.<port>.xmit_bytes`,
    `net.<nic>.sent_bytes`), so the analyzers difference them the same way; other metrics
    (congestion, waits, ...) are kept as read, named `nic.<nic>.<port>.<metric>`."""
    if not _need(db, "NET_NIC_METRIC", {"start", "end", "globalId", "portId", "metricsListId",
                                        "metricsIdx", "value"}):
        return 0
    metrics: dict[tuple[int, int], tuple[str, str]] = {}
    if _need(db, "TARGET_INFO_NETWORK_METRICS", {"metricsListId", "metricsIdx", "name",
                                                 "unit"}):
        metrics = {(ls, ix): (str(n), str(u or "")) for ls, ix, n, u in db.rows(
            "SELECT metricsListId, metricsIdx, name, unit FROM TARGET_INFO_NETWORK_METRICS")}
    nic_of: dict[int, str] = {}
    if _need(db, "NIC_ID_MAP", {"nicId", "globalId"}) and \
            _need(db, "TARGET_INFO_NIC_INFO", {"nicId", "name"}):
        names = {nid: str(n) for nid, n in db.rows("SELECT nicId, name FROM TARGET_INFO_NIC_INFO")}
        nic_of = {g: _slug(names[nid]) for nid, g in db.rows(
            "SELECT nicId, globalId FROM NIC_ID_MAP") if nid in names}
    totals: dict[str, float] = {}
    n = 0
    for s, e, gid, port, ls, ix, value in db.rows(
            'SELECT start, "end", globalId, portId, metricsListId, metricsIdx, value '
            "FROM NET_NIC_METRIC ORDER BY start"):
        start = _int(s, "NIC metric start") + offset
        end = _int(e, "NIC metric end") + offset if e is not None else start
        if not isinstance(value, int | float):
            raise ImportFailed(f"NIC metric value is {value!r}, not a number")
        metric, unit = metrics.get((ls, ix), (f"metric{ls}_{ix}", ""))
        nic = nic_of.get(gid, f"nic{gid}")
        low = metric.lower()
        ib = low.startswith("ib:")
        key = low.split(":", 1)[1].strip() if ib else low
        # IPoIB/RoCE ("IPoIB: Bytes sent") match no counter: part of the port's IB bytes
        counter = (_IB_COUNTERS if ib else _NET_COUNTERS).get(key)
        n += 1
        if counter is None:
            rows.add("sample", "net", f"nic.{nic}.{port}.{_slug(metric)}", end,
                     value=float(value), unit=unit)
            continue
        cat = "ib" if ib else "net"
        name = f"ib.{nic}.{port}.{counter}" if ib else f"net.{nic}.{counter}"
        kind = "packets" if "packets" in counter else "bytes"
        if name not in totals:
            totals[name] = 0.0
            rows.add("sample", cat, name, start, value=0.0, unit=kind)
        totals[name] += _amount(float(value), unit, end - start)
        rows.add("sample", cat, name, end, value=totals[name], unit=kind)
    return n
