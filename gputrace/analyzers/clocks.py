"""Clock offsets between hosts, from events every rank sees at the same moment.

A blocking collective (a gradient bucket's all-reduce, a barrier) completes on every rank at
once, give or take one message's latency: the last rank to arrive releases them all. Where
the same unit of the same step ends on ranks of two hosts, the difference of the end times
is the difference of the hosts' clocks plus that small noise; its median over every shared
unit is the offset, and its spread says how sure that is. No I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MIN_MATCHES = 3     # shared units below which a host's offset is not estimated


@dataclass(frozen=True)
class UnitEnds:
    """When one rank's comm units ended: (step, unit index) -> end, trace ns."""

    step: np.ndarray
    index: np.ndarray
    end: np.ndarray


@dataclass(frozen=True)
class HostClock:
    host: str
    ranks: list[int]
    offset_s: float | None       # its clock minus the reference host's (None: unknown)
    uncertainty_s: float | None  # standard error of that median
    spread_s: float | None       # robust std of the per-unit differences
    matched: int                 # units it shares with the reference host
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


def _per_unit(ends: list[UnitEnds]) -> tuple[np.ndarray, np.ndarray]:
    """Keys (step, index) packed in one int64 each, and the median end over the ranks given,
    one per key, sorted by key."""
    step = np.concatenate([e.step for e in ends]).astype(np.int64)
    index = np.concatenate([e.index for e in ends]).astype(np.int64)
    end = np.concatenate([e.end for e in ends]).astype(np.int64)
    ok = step >= 0
    key = (step[ok] << 20) | (index[ok] & 0xFFFFF)
    end = end[ok]
    if not key.size:
        return key, end.astype(np.float64)
    order = np.lexsort((end, key))
    key, end = key[order], end[order]
    first = np.flatnonzero(np.r_[True, key[1:] != key[:-1]])
    counts = np.diff(np.r_[first, key.size])
    mid = first + (counts - 1) // 2          # the lower median of each key's ends
    mid2 = first + counts // 2
    return key[first], (end[mid].astype(np.float64) + end[mid2]) / 2


def estimate(ranks: dict[int, tuple[str, UnitEnds]], apply: bool = True
             ) -> ClockAlignment | None:
    """Each host's clock offset against the host of the lowest rank, from the comm units
    that ranks on both ended; None with fewer than two hosts."""
    by_host: dict[str, list[int]] = {}
    for r, (host, _) in sorted(ranks.items()):
        by_host.setdefault(host, []).append(r)
    if len(by_host) < 2:
        return None
    ref = ranks[min(ranks)][0]
    ref_key, ref_end = _per_unit([ranks[r][1] for r in by_host[ref]])
    out = {ref: HostClock(ref, by_host[ref], 0.0, 0.0, 0.0, int(ref_key.size),
                          "reference")}
    for host, rs in by_host.items():
        if host == ref:
            continue
        key, end = _per_unit([ranks[r][1] for r in rs])
        common, a, b = np.intersect1d(key, ref_key, assume_unique=True, return_indices=True)
        if common.size < MIN_MATCHES:
            out[host] = HostClock(host, rs, None, None, None, int(common.size),
                                  f"only {common.size} comm units shared with {ref}: "
                                  "offset not estimated, times taken as recorded")
            continue
        d = end[a] - ref_end[b]
        med = float(np.median(d))
        spread = 1.4826 * float(np.median(np.abs(d - med)))
        # the median's standard error under a normal spread: 1.2533 sigma / sqrt(n)
        err = 1.2533 * spread / np.sqrt(d.size)
        out[host] = HostClock(host, rs, med / 1e9, err / 1e9, spread / 1e9, int(d.size))
    return ClockAlignment(ref, out, apply)
