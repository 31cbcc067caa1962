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
    if not steps:
        return {}, {}
    parts: list[list[np.ndarray]] = [[] for _ in range(6)]
    for k, (r, rs) in enumerate(steps.items()):
        u = rs.units
        rows = u.rows(sels[r])
        off = offsets.get(r, 0)
        for col, x in zip(parts, (np.full(rows.size, k, np.int32),
                                  rs.iterations.step[u.it[rows]], u.index[rows],
                                  u.start[rows] - off, u.end[rows] - off, rows), strict=True):
            col.append(x)
    # the ranks' rows together, sorted by (step, unit, rank), a column at a time, each
    # one's pieces (or unsorted whole) freed before the next (at 1e8 events over 1024
    # ranks the columns of every rank's units twice over were 0.5 GB of the peak)
    cols = []
    for col in parts:
        cols.append(np.concatenate(col))
        col.clear()
    arrivals = {r: rs.units.start.copy() for r, rs in steps.items()}
    n = cols[0].size
    if not n:
        return {}, arrivals
    order = np.lexsort((cols[0], cols[2], cols[1]))
    for i in range(len(cols)):
        cols[i] = cols[i][order]
    del order
    who, step, index, start, end, row = cols
    del cols
    new = np.empty(n, bool)
    new[0] = True
    np.not_equal(step[1:], step[:-1], out=new[1:])
    new[1:] |= index[1:] != index[:-1]
    del step, index
    first = np.flatnonzero(new)
    group = np.cumsum(new) - 1
    del new
    shared = (np.diff(np.r_[first, n]) >= 2)[group]
    last = np.maximum.reduceat(start, first)[group]   # the last rank to arrive
    del group, first
    # each rank's shared rows, in the sorted order (so its sums add as they did)
    idx = np.flatnonzero(shared)
    idx = idx[np.argsort(who[idx], kind="stable")]
    bounds = np.searchsorted(who[idx], np.arange(len(steps) + 1))
    out = {}
    for k, r in enumerate(steps):
        m = idx[bounds[k]:bounds[k + 1]]
        if m.size:
            iters = max(len(sels[r]), 1)
            out[r] = (float(((last[m] - start[m]) / 1e9).sum()) / iters,
                      float((np.maximum(end[m] - last[m], 0) / 1e9).sum()) / iters)
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
