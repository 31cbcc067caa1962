"""Interval algebra over sorted, disjoint unions, vectorized with numpy.

A union is a pair (starts, ends) of int64/float arrays, sorted and non-overlapping.
`measure(u, lo, hi)` gives the covered length inside each window [lo, hi) in O(log n), so
per-iteration figures over millions of spans stay fast.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

Union = tuple[np.ndarray, np.ndarray]

EMPTY: Union = (np.zeros(0, np.int64), np.zeros(0, np.int64))


def union(starts: np.ndarray, ends: np.ndarray, own: bool = False) -> Union:
    """Merge intervals into a sorted, disjoint union (touching intervals merge). `own`:
    the arrays are the caller's throwaway copies, and may be worked on in place."""
    starts = np.asarray(starts, dtype=np.int64)
    ends = np.asarray(ends, dtype=np.int64)
    keep = ends > starts
    if not keep.all():
        starts, ends, own = starts[keep], ends[keep], True
    del keep
    if starts.size == 0:
        return EMPTY
    if starts.size > 1 and not (starts[1:] >= starts[:-1]).all():
        order = np.argsort(starts, kind="stable")  # spans usually come sorted already
        s, e, own = starts[order], ends[order], True
        del order
    else:
        s, e = starts, ends
    run_end = np.maximum.accumulate(e, out=e if own else None)
    # a new merged interval begins where a start lies beyond every earlier end
    new = np.empty(s.size, dtype=bool)
    new[0] = True
    np.greater(s[1:], run_end[:-1], out=new[1:])
    idx = np.flatnonzero(new)
    del new
    out_s = s[idx]
    idx[:-1] = idx[1:] - 1     # each interval's last member
    idx[-1] = s.size - 1
    return out_s, run_end[idx]


def merge(*unions: Union) -> Union:
    if not unions:
        return EMPTY
    return union(np.concatenate([u[0] for u in unions]), np.concatenate([u[1] for u in unions]),
                 own=True)


def total(u: Union) -> int:
    return int((u[1] - u[0]).sum())


def _cover_before(u: Union, x: np.ndarray) -> np.ndarray:
    """Covered length of u on (-inf, x) for each x."""
    s, e = u
    if s.size == 0:
        return np.zeros(np.shape(x), dtype=np.float64)
    cum = np.concatenate(([0], np.cumsum(e - s)))
    i = np.searchsorted(s, x, side="right") - 1
    inside = np.clip(x - s[np.maximum(i, 0)], 0, (e - s)[np.maximum(i, 0)])
    return np.where(i >= 0, cum[np.maximum(i, 0)] + inside, 0).astype(np.float64)


def measure(u: Union, lo: np.ndarray | int, hi: np.ndarray | int) -> np.ndarray:
    """Covered length of the union inside each window [lo, hi)."""
    lo = np.asarray(lo, dtype=np.int64)
    hi = np.asarray(hi, dtype=np.int64)
    return np.maximum(_cover_before(u, hi) - _cover_before(u, lo), 0.0)


def _covered(u: Union, x: np.ndarray) -> np.ndarray:
    """Whether each point x lies inside the union."""
    i = np.searchsorted(u[0], x, side="right") - 1
    return (i >= 0) & (x < u[1][np.maximum(i, 0)])


def _combine(a: Union, b: Union, keep_b: bool) -> Union:
    # Between consecutive boundaries of both unions coverage is constant: test the left end.
    pts = np.sort(np.concatenate([a[0], a[1], b[0], b[1]]), kind="stable")
    pts = pts[np.concatenate(([True], pts[1:] != pts[:-1]))]
    mid = pts[:-1]
    in_b = _covered(b, mid)
    keep = _covered(a, mid) & (in_b if keep_b else ~in_b)
    return union(pts[:-1][keep], pts[1:][keep], own=True)


def intersect(a: Union, b: Union) -> Union:
    """Intersection of two unions."""
    if a[0].size == 0 or b[0].size == 0:
        return EMPTY
    return _combine(a, b, keep_b=True)


def subtract(a: Union, b: Union) -> Union:
    """Parts of a not covered by b."""
    if a[0].size == 0 or b[0].size == 0:
        return a
    return _combine(a, b, keep_b=False)


@dataclass(frozen=True)
class Hidden:
    """Per-window total, hidden and exposed seconds of one activity against another."""

    total_s: np.ndarray
    hidden_s: np.ndarray
    exposed_s: np.ndarray


def hidden_under(activity: Union, cover: Union, lo: np.ndarray, hi: np.ndarray) -> Hidden:
    """How much of `activity` in each window runs while `cover` runs (hidden) or not."""
    tot = measure(activity, lo, hi)
    # |A and B| = |A| + |B| - |A or B| in every window: one merge instead of an intersection
    hid = np.maximum(tot + measure(cover, lo, hi) - measure(merge(activity, cover), lo, hi), 0.0)
    return Hidden(tot / 1e9, hid / 1e9, (tot - hid) / 1e9)
