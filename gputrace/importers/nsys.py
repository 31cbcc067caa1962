"""Nsight Systems SQLite export (`nsys export --type sqlite`) -> trace v1 rows."""

from __future__ import annotations

import json
import re
import sqlite3
from typing import Any

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
        for s, e, et, text, tid_, gtid, dom in db.rows(
                "SELECT start, end, eventType, text, textId, globalTid, domainId "
                f"FROM NVTX_EVENTS WHERE eventType IN ({_NVTX_RANGES[0]}, {_NVTX_RANGES[1]}, "
                f"{_NVTX_MARK}) ORDER BY start"):
            name = text if text is not None else strings.get(tid_, "")
            name = str(name)
            pid, tid = _pid(gtid or 0), _tid(gtid or 0)
            start = _int(s, "NVTX start") + offset
            rank = rank_of.get(pid, -1)
            if et == _NVTX_MARK:
                rows.add("instant", "user", name, start, rank=rank, pid=pid, tid=tid)
                continue
            n += 1
            end = _int(e, "NVTX end") + offset if e is not None else None
            ph, step = phase_of(name)
            args = None
            if dom and domains.get(dom) and domains[dom] != "gputrace":
                args = json.dumps({"domain": domains[dom]})
            rows.add("span", ph or "user", name, start, end, rank=rank, pid=pid, tid=tid,
                     step=step, args=args)
            if end is not None and ph == "iteration":
                iters.append((start, end, step if step >= 0 else len(iters)))
                iter_threads[(pid, tid)] = iter_threads.get((pid, tid), 0) + 1
            elif end is not None and ph is not None:
                phases.append(((pid, tid), start, end, ph))
        counts["nvtx_ranges"] = n

    launches = Launches()
    if _need(db, "CUPTI_ACTIVITY_KIND_RUNTIME", {"start", "globalTid", "correlationId"}):
        for s, gtid, corr in db.rows(
                "SELECT start, globalTid, correlationId FROM CUPTI_ACTIVITY_KIND_RUNTIME"):
            pid = _pid(gtid)
            launches.call(pid, corr, pid, _tid(gtid), _int(s, "runtime start") + offset)

    fixed: set[int] = set()
    h2d: set[int] = set()
    kcols = {"start", "end", "deviceId", "streamId", "correlationId", "globalPid",
             "demangledName", "shortName"}
    if _need(db, "CUPTI_ACTIVITY_KIND_KERNEL", kcols):
        n = 0
        for s, e, dev, stream, corr, gp, dname, sname in db.rows(
                "SELECT start, end, deviceId, streamId, correlationId, globalPid, "
                "demangledName, shortName FROM CUPTI_ACTIVITY_KIND_KERNEL ORDER BY start"):
            pid = _pid(gp)
            short = strings.get(sname, "")
            name = strings.get(dname, short)
            nccl = is_nccl(short) or is_nccl(name)
            i = rows.add("span", "comm" if nccl else "kernel", name, _int(s, "kernel start")
                         + offset, _int(e, "kernel end") + offset, rank=rank_of.get(pid, -1),
                         pid=pid, device=_small(dev), stream=_small(stream), corr=corr,
                         phase="comm" if nccl else None)
            launches.gpu(i, pid, corr)
            if nccl:
                fixed.add(i)
            n += 1
        counts["kernels"] = n
    mcols = {"start", "end", "deviceId", "streamId", "correlationId", "globalPid", "bytes",
             "copyKind", "srcKind", "dstKind"}
    if _need(db, "CUPTI_ACTIVITY_KIND_MEMCPY", mcols):
        n = 0
        peer = {"srcDeviceId", "dstDeviceId"} <= db.columns("CUPTI_ACTIVITY_KIND_MEMCPY")
        extra = ", srcDeviceId, dstDeviceId" if peer else ", NULL, NULL"
        for s, e, dev, stream, corr, gp, nb, kind, sk, dk, sd, dd in db.rows(
                "SELECT start, end, deviceId, streamId, correlationId, globalPid, bytes, "
                f"copyKind, srcKind, dstKind{extra} FROM CUPTI_ACTIVITY_KIND_MEMCPY "
                "ORDER BY start"):
            pid = _pid(gp)
            args = None
            if sd is not None or dd is not None:
                args = json.dumps({"src_device": int(sd if sd is not None else -1),
                                   "dst_device": int(dd if dd is not None else -1)})
            i = rows.add("span", "memcpy", f"Memcpy {_COPY.get(kind, 'unknown')}",
                         _int(s, "memcpy start") + offset, _int(e, "memcpy end") + offset,
                         rank=rank_of.get(pid, -1), pid=pid, device=_small(dev), stream=_small(stream),
                         corr=corr, bytes=nb, src_kind=_MEM_KIND.get(sk),
                         dst_kind=_MEM_KIND.get(dk), args=args)
            if _MEM_KIND.get(dk) == "device" and _MEM_KIND.get(sk) in ("pageable", "pinned"):
                h2d.add(i)
            launches.gpu(i, pid, corr)
            n += 1
        counts["memcpy"] = n
    if _need(db, "CUPTI_ACTIVITY_KIND_MEMSET", {"start", "end", "deviceId", "streamId",
                                                "correlationId", "globalPid", "bytes"}):
        n = 0
        for s, e, dev, stream, corr, gp, nb in db.rows(
                "SELECT start, end, deviceId, streamId, correlationId, globalPid, bytes "
                "FROM CUPTI_ACTIVITY_KIND_MEMSET ORDER BY start"):
            pid = _pid(gp)
            i = rows.add("span", "memset", "Memset", _int(s, "memset start") + offset,
                         _int(e, "memset end") + offset, rank=rank_of.get(pid, -1), pid=pid,
                         device=_small(dev), stream=_small(stream), corr=corr, bytes=nb)
            launches.gpu(i, pid, corr)
            n += 1
        counts["memset"] = n
    if _need(db, "CUPTI_ACTIVITY_KIND_SYNCHRONIZATION", {"start", "end", "deviceId",
                                                         "streamId", "globalPid"}):
        for s, e, dev, stream, gp in db.rows(
                "SELECT start, end, deviceId, streamId, globalPid "
                "FROM CUPTI_ACTIVITY_KIND_SYNCHRONIZATION"):
            pid = _pid(gp)
            rows.add("span", "sync", "synchronize", _int(s, "sync start") + offset,
                     _int(e, "sync end") + offset, rank=rank_of.get(pid, -1), pid=pid,
                     device=_small(dev), stream=_small(stream))
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
