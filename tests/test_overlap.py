"""Interval algebra against a brute-force reference (property tests)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from gputrace.analyzers import overlap as ov

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
    assert np.array_equal(cover(*ov.intersect(ua, ub)), ca & cb)
    assert np.array_equal(cover(*ov.subtract(ua, ub)), ca & ~cb)
    h = ov.hidden_under(ua, ub, np.array([0]), np.array([300]))
    assert round(h.total_s[0] * 1e9) == ca.sum()
    assert round(h.hidden_s[0] * 1e9) == (ca & cb).sum()
    assert round(h.exposed_s[0] * 1e9) == (ca & ~cb).sum()
