"""The samples of an Nsight Systems export besides its timeline: GPU metrics
(`--gpu-metrics-devices`) and NIC counters (`--nic-metrics`), named as gputrace's own
collectors name theirs."""

from __future__ import annotations

from gputrace.importers.common import ImportFailed, Rows
from gputrace.importers.nsys_db import Db, as_int, need, slug


def gpu_metrics(db: Db, rows: Rows, offset: int) -> int:
    """GPU_METRICS samples (`nsys --gpu-metrics-devices`), named `gpu.metric.<name>`."""
    if not need(db, "GPU_METRICS", {"timestamp", "typeId", "metricId", "value"}):
        return 0
    names: dict[tuple[int, int], str] = {}
    if need(db, "TARGET_INFO_GPU_METRICS", {"typeId", "metricId", "metricName"}):
        names = {(t, m): str(n) for t, m, n in db.rows(
            "SELECT typeId, metricId, metricName FROM TARGET_INFO_GPU_METRICS")}
    types = sorted({t for t, _ in names}) or []
    n = 0
    for ts, typ, mid, value in db.rows(
            "SELECT timestamp, typeId, metricId, value FROM GPU_METRICS ORDER BY timestamp"):
        name = names.get((typ, mid), f"metric{mid}")
        unit = "%" if ("%" in name or "Utilization" in name or "Throughput" in name) else ""
        rows.add("sample", "gpu", f"gpu.metric.{slug(name)}", as_int(ts, "timestamp") + offset,
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


def nic_metrics(db: Db, rows: Rows, offset: int) -> int:
    """NET_NIC_METRIC (`nsys --nic-metrics`): per NIC port, bytes and packets sent and
    received become cumulative counters like gputrace's own (`ib.<nic>.<port>.xmit_bytes`,
    `net.<nic>.sent_bytes`), so the analyzers difference them the same way; other metrics
    (congestion, waits, ...) are kept as read, named `nic.<nic>.<port>.<metric>`."""
    if not need(db, "NET_NIC_METRIC", {"start", "end", "globalId", "portId", "metricsListId",
                                        "metricsIdx", "value"}):
        return 0
    metrics: dict[tuple[int, int], tuple[str, str]] = {}
    if need(db, "TARGET_INFO_NETWORK_METRICS", {"metricsListId", "metricsIdx", "name",
                                                 "unit"}):
        metrics = {(ls, ix): (str(n), str(u or "")) for ls, ix, n, u in db.rows(
            "SELECT metricsListId, metricsIdx, name, unit FROM TARGET_INFO_NETWORK_METRICS")}
    nic_of: dict[int, str] = {}
    if need(db, "NIC_ID_MAP", {"nicId", "globalId"}) and \
            need(db, "TARGET_INFO_NIC_INFO", {"nicId", "name"}):
        names = {nid: str(n) for nid, n in db.rows("SELECT nicId, name FROM TARGET_INFO_NIC_INFO")}
        nic_of = {g: slug(names[nid]) for nid, g in db.rows(
            "SELECT nicId, globalId FROM NIC_ID_MAP") if nid in names}
    totals: dict[str, float] = {}
    n = 0
    for s, e, gid, port, ls, ix, value in db.rows(
            'SELECT start, "end", globalId, portId, metricsListId, metricsIdx, value '
            "FROM NET_NIC_METRIC ORDER BY start"):
        start = as_int(s, "NIC metric start") + offset
        end = as_int(e, "NIC metric end") + offset if e is not None else start
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
            rows.add("sample", "net", f"nic.{nic}.{port}.{slug(metric)}", end,
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
