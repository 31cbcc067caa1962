"""Interval algebra against a brute-force reference (property tests)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from gputrace.analyzers.core import overlap as ov

intervals = st.lists(st.tuples(st.integers(0, 200), st.integers(0, 60)), max_size=25).map(
    lambda xs: (np.array([a for a, _ in xs], np.int64), np.array([a + d for a, d in xs], np.int64)))


def cover(s, e, horizon=300):
    c = np.zeros(horizon, dtype=bool)
    for a, b in zip(s.tolist(), e.tolist(), strict=True):
        c[a:b] = True
    return c


@settings(max_examples=300, deadline=None)
@given(intervals)
def test_union_is_sorted_disjoint_and_covers_the_same_points(iv):
    before = (iv[0].copy(), iv[1].copy())
    u = ov.union(*iv)
    assert np.all(u[0][1:] > u[1][:-1])  # disjoint, not touching
    assert np.all(u[1] > u[0])
    assert np.array_equal(cover(*u), cover(*iv))
    assert ov.total(u) == cover(*iv).sum()
    assert all(np.array_equal(a, b) for a, b in zip(iv, before, strict=True))  # untouched
    owned = ov.union(iv[0].copy(), iv[1].copy(), own=True)   # worked on in place: same union
    assert all(np.array_equal(a, b) for a, b in zip(owned, u, strict=True))


@settings(max_examples=300, deadline=None)
@given(intervals, st.lists(st.tuples(st.integers(0, 260), st.integers(0, 80)), min_size=1,
                           max_size=8))
def test_measure_in_windows(iv, windows):
    u = ov.union(*iv)
    lo = np.array([a for a, _ in windows])
    hi = np.array([a + d for a, d in windows])
    got = ov.measure(u, lo, hi)
    c = cover(*iv)
    want = [c[a:b].sum() for a, b in zip(lo, hi, strict=True)]
    assert np.array_equal(got, np.array(want, dtype=float))


@settings(max_examples=300, deadline=None)
@given(intervals, intervals)
def test_intersect_and_subtract(a, b):
    ua, ub = ov.union(*a), ov.union(*b)
    ca, cb = cover(*a), cover(*b)
    for got, want in ((ov.intersect(ua, ub), ca & cb), (ov.subtract(ua, ub), ca & ~cb)):
        assert np.array_equal(cover(*got), want)
        assert np.all(got[0][1:] > got[1][:-1]) and np.all(got[1] > got[0])   # a union
    # raw intervals (overlapping, unsorted, empty ones) given as if a union: still right
    if a[0].size and b[0].size:
        assert np.array_equal(cover(*ov.intersect(a, b)), ca & cb)
        assert np.array_equal(cover(*ov.subtract(a, b)), ca & ~cb)
    h = ov.hidden_under(ua, ub, np.array([0]), np.array([300]))
    assert round(h.total_s[0] * 1e9) == ca.sum()
    assert round(h.hidden_s[0] * 1e9) == (ca & cb).sum()
    assert round(h.exposed_s[0] * 1e9) == (ca & ~cb).sum()


def test_grouped_exclusive_counts_each_instant_once_in_the_first_layer():
    """A copy beside a forward kernel (another stream), a backward overlapping the forward:
    each instant of a group counts once, in the first layer holding it; groups apart even
    where their intervals interleave in time (records of iteration 1 running during 0's)."""
    from gputrace.analyzers.core.overlap import grouped_exclusive

    s = np.array([0, 5, 8, 20, 15, 17])
    e = np.array([10, 12, 9, 30, 25, 40])
    g = np.array([0, 0, 0, 0, 1, 1])
    ly = np.array([0, 1, 3, 1, 0, 3])
    got = grouped_exclusive(s, e, g, ly, 2, 4)
    # group 0: forward 0-10; backward 5-12 less it: 2, and 20-30: 10; copy 8-9 under forward
    assert got[0].tolist() == [10, 12, 0, 0]
    # group 1: forward 15-25; copy 17-40 less it: 15 (group 0's 20-30 is no cover for it)
    assert got[1].tolist() == [10, 0, 0, 15]
    assert got.sum() == 47 and grouped_exclusive(s[:0], e[:0], g[:0], ly[:0], 2, 4).sum() == 0
