"""Interval algebra over sorted, disjoint unions, vectorized with numpy.

A union is a pair (starts, ends) of int64/float arrays, sorted and non-overlapping.
`measure(u, lo, hi)` gives the covered length inside each window [lo, hi) in O(log n), so
per-iteration figures over millions of spans stay fast.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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


def _combine(a: Union, b: Union, keep_b: bool) -> Union:
    """One sweep over both unions' edges (each union's are sorted already, so the stable
    sort merges two runs): how many of a's and of b's intervals cover each stretch between
    two distinct edges, counted at the stretch's left end, and the stretches kept laid end
    to end into intervals."""
    na, nb = a[0].size, b[0].size
    at = np.empty(2 * (na + nb), np.result_type(a[0], b[0]))
    at[0:2 * na:2], at[1:2 * na:2], at[2 * na::2], at[2 * na + 1::2] = a[0], a[1], b[0], b[1]
    order = np.argsort(at, kind="stable")
    at = at[order]
    # each edge's step of its union's coverage: +1 at a start (even place), -1 at an end
    step = (1 - 2 * (order & 1)).astype(np.int8)
    of_a = order < 2 * na
    in_a = np.cumsum(np.where(of_a, step, 0), dtype=np.int32)
    in_b = np.cumsum(np.where(of_a, 0, step), dtype=np.int32)
    # the coverage after the last edge at each position
    last = np.empty(at.size, dtype=bool)
    last[-1] = True
    np.not_equal(at[1:], at[:-1], out=last[:-1])
    at, in_a, in_b = at[last], in_a[last], in_b[last]
    by_b = in_b[:-1] > 0
    keep = (in_a[:-1] > 0) & (by_b if keep_b else ~by_b)
    # runs of kept stretches: each run's first stretch's start to its last's end
    edge = np.diff(np.concatenate(([0], keep.view(np.int8), [0])))
    return at[np.flatnonzero(edge == 1)], at[np.flatnonzero(edge == -1)]


def _proper(u: Union) -> bool:
    """Whether u is what `union` gives: intervals that last, in order, apart."""
    s, e = u
    return bool((e > s).all() and (s[1:] > e[:-1]).all())


def _pieces(a: Union, lo: np.ndarray, hi: np.ndarray, edge_s: Any, edge_e: Any
            ) -> Union:
    """For each interval i of a, the intervals k in [lo[i], hi[i]) of another sequence
    (their starts and ends as functions of k), each cut to i: in order, apart."""
    count = np.maximum(hi - lo, 0)
    total_n = int(count.sum())
    if total_n == 0:
        return (np.zeros(0, np.result_type(a[0])), np.zeros(0, np.result_type(a[1])))
    i = np.repeat(np.arange(a[0].size), count)
    # k runs from lo[i] up within each interval's block
    k = np.arange(total_n) - np.repeat(np.cumsum(count) - count, count) + lo[i]
    return np.maximum(a[0][i], edge_s(k)), np.minimum(a[1][i], edge_e(k))


def intersect(a: Union, b: Union) -> Union:
    """Intersection of two unions: for each interval of a, the intervals of b it meets, by
    binary search (its cost grows with a's intervals and the result, not with b's)."""
    if a[0].size == 0 or b[0].size == 0:
        return EMPTY
    if not (_proper(a) and _proper(b)):
        return _combine(a, b, keep_b=True)
    t = np.result_type(a[0], b[0])
    a = (a[0].astype(t, copy=False), a[1].astype(t, copy=False))
    bs, be = b[0].astype(t, copy=False), b[1].astype(t, copy=False)
    return _pieces(a, np.searchsorted(be, a[0], side="right"),
                   np.searchsorted(bs, a[1], side="left"), bs.__getitem__, be.__getitem__)


def subtract(a: Union, b: Union) -> Union:
    """Parts of a not covered by b: for each interval of a, the gaps of b it meets (gap k
    from b's interval k - 1's end to interval k's start, open at both ends of b), by binary
    search."""
    if a[0].size == 0 or b[0].size == 0:
        return a
    if not (_proper(a) and _proper(b)):
        return _combine(a, b, keep_b=False)
    t = np.result_type(a[0], b[0])
    a = (a[0].astype(t, copy=False), a[1].astype(t, copy=False))
    bs, be = b[0].astype(t, copy=False), b[1].astype(t, copy=False)
    nb = bs.size

    def gap_start(k: np.ndarray) -> np.ndarray:
        return np.where(k > 0, be[np.maximum(k - 1, 0)], a[0].min())

    def gap_end(k: np.ndarray) -> np.ndarray:
        return np.where(k < nb, bs[np.minimum(k, nb - 1)], a[1].max())
    # gap k meets a's interval when it ends after its start and starts before its end
    return _pieces(a, np.searchsorted(bs, a[0], side="right"),
                   np.searchsorted(be, a[1], side="left") + 1, gap_start, gap_end)


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


def _grouped(start: np.ndarray, end: np.ndarray, group: np.ndarray
             ) -> tuple[Union, np.ndarray, int, int] | None:
    """The union of each group's intervals, the groups laid end to end on one axis (each
    shifted by its index times the whole time range) so that one union does them all:
    (pieces on that axis, each piece's group, base, stride); None when nothing is given."""
    m = (group >= 0) & (end > start)
    if not m.any():
        return None
    s, e, g = start[m].astype(np.int64), end[m].astype(np.int64), group[m].astype(np.int64)
    base = int(s.min())
    stride = int(e.max()) - base + 1
    if stride * (int(g.max()) + 1) >= 2**62:     # too long a range to lay out: group by group
        parts = [(union(s[g == k], e[g == k]), k) for k in np.unique(g).tolist()]
        ps = np.concatenate([u[0] - base + k * stride for u, k in parts])
        pe = np.concatenate([u[1] - base + k * stride for u, k in parts])
        return (ps, pe), ps // stride, base, stride
    off = g * stride - base
    u = union(s + off, e + off, own=True)
    return u, u[0] // stride, base, stride


def grouped_measure(start: np.ndarray, end: np.ndarray, group: np.ndarray, n: int
                    ) -> np.ndarray:
    """Length of the union of each group's intervals, for groups 0..n-1 (-1: none):
    per-iteration time of records that belong to an iteration by their launch, wherever
    they ran (not clipped to any window)."""
    got = _grouped(start, end, group)
    if got is None:
        return np.zeros(n)
    (s, e), g, _, _ = got
    return np.bincount(g, weights=(e - s).astype(np.float64), minlength=n)[:n]


def grouped_exclusive(start: np.ndarray, end: np.ndarray, group: np.ndarray,
                      layer: np.ndarray, n: int, k: int) -> np.ndarray:
    """Per group (0..n-1) and layer (0..k-1, in priority order), the length of the union of
    that layer's intervals less every earlier layer's: each instant of a group counted once,
    in the first layer that holds it (two streams or a copy beside compute on a GPU)."""
    out = np.zeros((n, k))
    m = (group >= 0) & (end > start) & (layer >= 0) & (layer < k)
    if not m.any():
        return out
    s, e = start[m].astype(np.int64), end[m].astype(np.int64)
    g, ly = group[m].astype(np.int64), layer[m]
    base = int(s.min())
    stride = int(e.max()) - base + 1
    if stride * (int(g.max()) + 1) >= 2**62:     # too long a range to lay out: one by one
        for x in np.unique(g).tolist():
            w = g == x
            out[x] = grouped_exclusive(s[w], e[w], np.zeros(int(w.sum()), np.int64),
                                       ly[w], 1, k)[0]
        return out
    off = g * stride - base
    covered = EMPTY
    for j in range(k):
        w = ly == j
        u = union(s[w] + off[w], e[w] + off[w])
        only = subtract(u, covered)
        out[:, j] = np.bincount(only[0] // stride, weights=(only[1] - only[0]).astype(
            np.float64), minlength=n)[:n]
        covered = merge(covered, u)
    return out


def grouped_hidden(start: np.ndarray, end: np.ndarray, group: np.ndarray, n: int,
                   cover: Union) -> Hidden:
    """Per group, total / hidden / exposed seconds of the union of its intervals against
    `cover` (a union on the real time axis): comm hidden under compute on a GPU timeline."""
    got = _grouped(start, end, group)
    if got is None:
        z = np.zeros(n)
        return Hidden(z, z.copy(), z.copy())
    (s, e), g, base, stride = got
    shift = g * stride - base
    hid_piece = measure(cover, s - shift, e - shift)
    tot = np.bincount(g, weights=(e - s).astype(np.float64), minlength=n)[:n]
    hid = np.bincount(g, weights=hid_piece, minlength=n)[:n]
    return Hidden(tot / 1e9, hid / 1e9, (tot - hid) / 1e9)


def _in_order(*keys: np.ndarray) -> bool:
    """Whether rows are in order by their keys, the first most significant (as
    np.lexsort(keys[::-1]) would put them)."""
    later = np.zeros(keys[0].size - 1, bool)     # placed after the row before, already
    for k in keys:
        d = np.diff(k)
        if (~later & (d < 0)).any():
            return False
        later |= d > 0
    return True


def runs(start: np.ndarray, end: np.ndarray, group: np.ndarray, lane: np.ndarray,
         label: np.ndarray
         ) -> tuple[np.ndarray, ...]:
    """The runs of consecutive intervals with one label, in start order within each
    (group, lane): (start, end, group, label, index of its first interval, index of its
    last) of each run, from its first start to its last end. On a GPU a run is the time a
    phase held the device, idle gaps between its kernels (the host launching them)
    included."""
    m = np.flatnonzero(group >= 0)
    s, e, g, ln, lb = start[m], end[m], group[m], lane[m], label[m]
    if not s.size:
        z = np.zeros(0, np.int64)
        return z, z.copy(), z.copy(), z.copy(), z.copy(), z.copy()
    if not _in_order(g, ln, s):   # a device's records come in start order, mostly
        order = np.lexsort((s, ln, g))
        s, e, g, ln, lb, m = s[order], e[order], g[order], ln[order], lb[order], m[order]
    new = np.ones(s.size, dtype=bool)
    new[1:] = (g[1:] != g[:-1]) | (ln[1:] != ln[:-1]) | (lb[1:] != lb[:-1])
    first = np.flatnonzero(new)
    last = np.append(first[1:] - 1, s.size - 1)
    return s[first], np.maximum.reduceat(e, first), g[first], lb[first], m[first], m[last]


def busy_before(start: np.ndarray, end: np.ndarray, lane: np.ndarray, t: np.ndarray,
                t_lane: np.ndarray) -> np.ndarray:
    """For each time t on its lane: the latest end among the intervals of that lane that
    started before t (the lane's busy until then), or -1."""
    out = np.full(t.size, -1, dtype=np.int64)
    for ln in np.unique(t_lane).tolist():
        mine = lane == ln
        s, e = start[mine], end[mine]
        order = np.argsort(s, kind="stable")
        s, reach = s[order], np.maximum.accumulate(e[order]) if s.size else e
        want = t_lane == ln
        i = np.searchsorted(s, t[want], side="left") - 1
        out[want] = np.where(i >= 0, reach[np.maximum(i, 0)], -1) if s.size else -1
    return out


def summary(h: Any, sel: np.ndarray) -> dict[str, float]:
    """Means over the iterations `sel` of an overlap's total, hidden and exposed seconds."""
    tot = float(np.mean(h.total_s[sel])) if sel.size else 0.0
    hid = float(np.mean(h.hidden_s[sel])) if sel.size else 0.0
    exp = float(np.mean(h.exposed_s[sel])) if sel.size else 0.0
    return {"total_s": tot, "hidden_s": hid, "exposed_s": exp,
            "hidden_fraction": hid / tot if tot > 0 else 0.0}
