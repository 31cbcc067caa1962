"""Clock offsets between hosts, from the collectives every rank takes part in.

A blocking collective (a gradient unit's all-reduce, a barrier) completes on every rank at
about the same moment: the last rank to arrive releases them all. A rank records that
moment late by however long its completion callback waited for a core and the interpreter
(milliseconds on a busy machine), never early. So for each unit of each step shared by two
hosts, the earliest end among each host's ranks is the least delayed, and the difference of
the two is the clock offset plus noise; the median over every shared unit is the estimate.
Its uncertainty: its standard error, and (in quadrature) how far it lies from the middle of
the densest half of the differences, where one host's ends are delayed more than the
other's.

Causality also bounds the offset: no rank ends a unit before every rank has started it, so
with B's clock ahead of A's by theta,

    max(start on B) - min(end on A)  <=  theta  <=  min(end on B) - max(start on A)

over every shared unit. The estimate is kept inside these bounds (reported beside it). No
I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

MIN_MATCHES = 3     # shared units below which a host's offset is not estimated


@dataclass(frozen=True)
class UnitTimes:
    """One rank's comm units: step, launch index, start and end (trace ns)."""

    step: np.ndarray
    index: np.ndarray
    start: np.ndarray
    end: np.ndarray


@dataclass(frozen=True)
class HostClock:
    host: str
    ranks: list[int]
    offset_s: float | None       # its clock minus the reference host's (None: unknown)
    uncertainty_s: float | None  # the median's standard error and its distance from the shorth
    spread_s: float | None       # robust std of the per-unit differences of end times
    matched: int                 # units it shares with the reference host
    bounds_s: tuple[float, float] | None = None   # what causality allows the offset to be
    note: str = ""


@dataclass(frozen=True)
class ClockAlignment:
    reference: str               # the host whose clock the others are put on
    hosts: dict[str, HostClock]
    applied: bool                # False: estimated and reported, not applied (--no-align)

    def offset_ns(self, host: str) -> int:
        """What to subtract from a host's times to put them on the reference clock."""
        h = self.hosts.get(host)
        if not self.applied or h is None or h.offset_s is None:
            return 0
        return round(h.offset_s * 1e9)


def _per_unit(units: list[UnitTimes]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per (step, index) key, over the ranks given, sorted by key: the key packed in one
    int64, the latest start and the earliest end."""
    step = np.concatenate([u.step for u in units]).astype(np.int64)
    index = np.concatenate([u.index for u in units]).astype(np.int64)
    start = np.concatenate([u.start for u in units]).astype(np.int64)
    end = np.concatenate([u.end for u in units]).astype(np.int64)
    ok = step >= 0
    key = (step[ok] << 20) | (index[ok] & 0xFFFFF)
    start, end = start[ok], end[ok]
    if not key.size:
        return key, start, end
    order = np.argsort(key, kind="stable")
    key, start, end = key[order], start[order], end[order]
    first = np.flatnonzero(np.r_[True, key[1:] != key[:-1]])
    return key[first], np.maximum.reduceat(start, first), np.minimum.reduceat(end, first)


def _densest_half(d: np.ndarray) -> float:
    """The middle of the shortest interval that holds half of the values (the shorth)."""
    v = np.sort(d)
    h = v.size // 2 + 1
    k = int(np.argmin(v[h - 1:] - v[:v.size - h + 1]))
    return float(v[k] + v[k + h - 1]) / 2


def estimate(ranks: Mapping[int, tuple[str, UnitTimes]], apply: bool = True,
             hosts: Mapping[int, str] | None = None) -> ClockAlignment | None:
    """Each host's clock offset against the host of the lowest rank, from the comm units
    that ranks on both took part in; None with fewer than two hosts. `hosts`: each rank's
    host, where reading `ranks` costs (its values made when read: then each rank's units
    are read once, a host's ranks at a time)."""
    hosts = hosts if hosts is not None else {r: h for r, (h, _) in ranks.items()}
    by_host: dict[str, list[int]] = {}
    for r, host in sorted(hosts.items()):
        by_host.setdefault(host, []).append(r)
    if len(by_host) < 2:
        return None
    ref = hosts[min(hosts)]
    rk, r_start, r_end = _per_unit([ranks[r][1] for r in by_host[ref]])
    out = {ref: HostClock(ref, by_host[ref], 0.0, 0.0, 0.0, int(rk.size), note="reference")}
    for host, rs in by_host.items():
        if host == ref:
            continue
        key, start, end = _per_unit([ranks[r][1] for r in rs])
        common, a, b = np.intersect1d(key, rk, assume_unique=True, return_indices=True)
        if common.size < MIN_MATCHES:
            out[host] = HostClock(host, rs, None, None, None, int(common.size),
                                  note=f"only {common.size} comm units shared with {ref}: "
                                  "offset not estimated, times taken as recorded")
            continue
        d = (end[a] - r_end[b]).astype(np.float64)
        mid = float(np.median(d))
        spread = 1.4826 * float(np.median(np.abs(d - mid)))
        # the median's standard error under a normal spread: 1.2533 sigma / sqrt(n); and how
        # far the median lies from the middle of the densest half of the differences: each
        # end is late by a delay of its own host's, never early, so where one host's ranks
        # wait longer for a core the differences' tail on its side is heavier and drags the
        # median off the offset, which the standard error does not tell (one run of 4 ranks
        # on 2 cores beside other work: the median 3.5 ms off, its standard error 0.7 ms)
        err = float(np.hypot(1.2533 * spread / np.sqrt(d.size), mid - _densest_half(d)))
        lo = float(np.max(start[a] - r_end[b]))     # theta >= B's start - A's end
        hi = float(np.min(end[a] - r_start[b]))     # theta <= B's end - A's start
        note = ""
        if lo <= hi and not lo <= mid <= hi:
            mid = min(max(mid, lo), hi)
            note = "the median fell outside the causal bounds: held to the nearer bound"
        elif lo > hi:
            note = ("the causal bounds contradict each other (spans that are not the same "
                    "collectives on every rank?)")
        out[host] = HostClock(host, rs, mid / 1e9, err / 1e9, spread / 1e9, int(d.size),
                              (lo / 1e9, hi / 1e9) if lo <= hi else None, note)
    return ClockAlignment(ref, out, apply)
