"""What the ranks of one run share: the wait for the last rank in each comm unit, the cores
or GPU the measured ranks computed on, the host's own all-reduce rate."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from gputrace.analyzers.core.overlap import total, union
from gputrace.analyzers.core.steps import RankSteps
from gputrace.analyzers.run.packed import Packed, pack

UNIT_KEY = 1 << 24     # above any unit's launch order in its iteration


def _comm_wait(steps: Mapping[int, RankSteps], sels: dict[int, np.ndarray],
               offsets: dict[int, int] | None = None
               ) -> tuple[dict[int, tuple[float, float]], dict[int, Packed[np.ndarray]]]:
    """Where several ranks show the same unit of the same step, the transfer can only start
    when the last rank arrives: a unit waits from its own start to that moment, transfers
    from then to its end. A rank's transfer time is the wall time some unit of its
    transferred, its wait the rest of the wall time its units were in flight (units in
    flight together, as gloo's and NCCL's queued all-reduces are, are not counted twice).
    `offsets`: what to subtract from each rank's times to put it on one clock (its host's
    clock offset). Returns per rank (wait, transfer) seconds per iteration, and the last
    arrival (ns, on the rank's own clock) of each of its unit rows (its own start where no
    other rank shows the unit), held packed (analyzers.run.packed: 1024 ranks' unpacked
    were 29 MB at 1e8 events).

    Three passes over the ranks, one at a time, each rank's rows sorted again in each
    (cheap beside holding them): the distinct (step, unit) keys, then per key the latest
    start and how many rows show it, then each rank's wait and transfer: at 1e8 events
    over 1024 ranks, sorting every rank's rows together held 250 MB more at its peak."""
    offsets = offsets or {}
    if not steps:
        return {}, {}
    keys = np.zeros(0, np.int64)
    for r, rs in steps.items():
        keys = np.union1d(keys, _keyed(rs, sels[r])[1])
    last = np.full(keys.size, np.iinfo(np.int64).min, np.int64)   # the last rank to arrive
    count = np.zeros(keys.size, np.int64)
    if keys.size:
        for r, rs in steps.items():
            rows, key = _keyed(rs, sels[r])
            pos = np.searchsorted(keys, key)
            np.maximum.at(last, pos, rs.units.start[rows] - offsets.get(r, 0))
            np.add.at(count, pos, 1)
    out, arrivals = {}, {}
    for r, rs in steps.items():
        arrival = rs.units.start.copy()
        rows, key = _keyed(rs, sels[r])    # (none where no rank has a key)
        pos = np.searchsorted(keys, key)
        m = count[pos] >= 2
        if m.any():
            off = offsets.get(r, 0)
            rows, lt = rows[m], last[pos[m]]
            start, end = rs.units.start[rows] - off, rs.units.end[rows] - off
            iters = max(len(sels[r]), 1)
            # wall time, not a sum of units in flight together: transferring while any of
            # them moves, waiting while some are in flight and none moves
            moving = total(union(np.clip(lt, start, end), end))
            out[r] = ((total(union(start, end)) - moving) / 1e9 / iters, moving / 1e9 / iters)
            arrival[rows] = np.minimum(lt, end) + off
        arrivals[r] = pack(arrival)
    return out, arrivals


def _keyed(rs: RankSteps, sel: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The rank's unit rows in the iterations `sel`, sorted by (step, unit), and each
    one's key step * UNIT_KEY + unit (one key the same on every rank without a pass over
    the ranks for their largest unit index)."""
    u = rs.units
    rows = u.rows(sel)
    step = rs.iterations.step[u.it[rows]].astype(np.int64)
    index = u.index[rows].astype(np.int64)
    o = np.lexsort((index, step))
    return rows[o], step[o] * UNIT_KEY + index[o]


def _shared(steps: Mapping[int, RankSteps], devices: dict[int, tuple[int, ...]], md: Any
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
