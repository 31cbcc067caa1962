"""What the ranks of one run share: the wait for the last rank in each comm unit, the cores
or GPU the measured ranks computed on, the host's own all-reduce rate."""

from __future__ import annotations

from typing import Any

import numpy as np

from gputrace.analyzers.core.steps import RankSteps


def _comm_wait(steps: dict[int, RankSteps], sels: dict[int, np.ndarray],
               offsets: dict[int, int] | None = None
               ) -> tuple[dict[int, tuple[float, float]], dict[int, np.ndarray]]:
    """Where several ranks show the same unit of the same step, the transfer can only start
    when the last rank arrives: wait = that moment - own start; transfer = end - that.
    `offsets`: what to subtract from each rank's times to put it on one clock (its host's
    clock offset). Returns per rank (wait, transfer) seconds per iteration, and the last
    arrival (ns, on the rank's own clock) of each of its unit rows (its own start where no
    other rank shows the unit)."""
    offsets = offsets or {}
    parts = []
    for r, rs in steps.items():
        u = rs.units
        rows = u.rows(sels[r])
        off = offsets.get(r, 0)
        parts.append((np.full(rows.size, r), rs.iterations.step[u.it[rows]], u.index[rows],
                      u.start[rows] - off, u.end[rows] - off, rows))
    rank, step, index, start, end, row = (np.concatenate(x) for x in zip(*parts, strict=True))
    arrivals = {r: rs.units.start.copy() for r, rs in steps.items()}
    if not rank.size:
        return {}, arrivals
    order = np.lexsort((rank, index, step))
    rank, step, index, start, end, row = (x[order] for x in (rank, step, index, start, end,
                                                             row))
    new = np.r_[True, (step[1:] != step[:-1]) | (index[1:] != index[:-1])]
    group = np.cumsum(new) - 1
    first = np.flatnonzero(new)
    size = np.diff(np.r_[first, rank.size])[group]
    last = np.maximum.reduceat(start, first)[group]   # the last rank to arrive
    shared = size >= 2
    wait = np.where(shared, (last - start) / 1e9, 0.0)
    xfer = np.where(shared, np.maximum(end - last, 0) / 1e9, 0.0)
    out = {}
    for r in steps:
        m = shared & (rank == r)
        if m.any():
            iters = max(len(sels[r]), 1)
            out[r] = (float(wait[m].sum()) / iters, float(xfer[m].sum()) / iters)
            arrivals[r][row[m]] = np.minimum(last[m], end[m]) + offsets.get(r, 0)
    return out, arrivals


def _shared(steps: dict[int, RankSteps], devices: dict[int, tuple[int, ...]], md: Any
            ) -> str | None:
    """What the measured ranks shared: one host's cores (ranks computing on the CPU, all on
    one host) or one GPU (ranks whose GPU records name the same device on one host)."""
    if len(steps) < 2:
        return None
    hosts = md.get("hosts") if isinstance(md, dict) else None
    one_host = isinstance(hosts, list) and len(hosts) == 1
    if not one_host:
        return None
    if not any(rs.gpu for rs in steps.values()):
        cpus = md.get("cpus") if isinstance(md.get("cpus"), int) else None
        return (f"the {cpus} CPU cores of host {hosts[0]}" if cpus else
                f"the CPU cores of host {hosts[0]}") + f" ({len(steps)} ranks computing on it)"
    used: dict[int, int] = {}
    for devs in devices.values():
        for d in devs:
            used[d] = used.get(d, 0) + 1
    both = [d for d, n in used.items() if n > 1]
    if both:
        return f"GPU {both[0]} of host {hosts[0]} ({used[both[0]]} ranks on it)"
    return None


def _host_bandwidth(md: Any) -> float | None:
    """The host's own all-reduce bus bandwidth over gloo (`gputrace probe` among local
    processes on the CPU): the least CPU each byte of comm on the CPU costs."""
    probe = md.get("probe") if isinstance(md, dict) else None
    v = ((probe or {}).get("results") or {}).get("allreduce_bus") if isinstance(probe, dict) \
        else None
    if isinstance(v, dict) and v.get("backend") == "gloo" and \
            isinstance(v.get("bytes_per_s"), (int, float)):
        return float(v["bytes_per_s"])
    return None


def _link_from_probe(probe: Any) -> float | None:
    if isinstance(probe, dict):
        for key in ("allreduce_bus", "ib", "p2p"):
            v = (probe.get("results") or {}).get(key)
            if isinstance(v, dict) and isinstance(v.get("bytes_per_s"), (int, float)):
                return float(v["bytes_per_s"])
    return None


def _md_world(md: Any) -> int:
    w = md.get("world_size") if isinstance(md, dict) else None
    return w if isinstance(w, int) else 0
