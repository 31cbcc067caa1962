"""What the replay reads from the run: the measured comm units of the analyzed iterations
(when each had the link, its bytes, when it could start and how much later it did, its idle
wait for the last rank), their busy time beside backward and after it, and each layer's
gradient ready time and bytes."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from gputrace.analyzers.core.steps import RankSteps


def units_in_iterations(rs: RankSteps, sel: np.ndarray
                       ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The measured units of the iterations `sel`: (row, iteration, begin, end, bytes) with
    times in ns from the iteration start; `begin` is when the unit had the link: its start,
    or the end of the units before it in its iteration when they were still running."""
    u = rs.units
    rows = u.rows(sel)
    if not rows.size:
        z = np.zeros(0)
        return rows, rows, z, z, z
    it = u.it[rows]
    t0 = rs.iterations.start[it]
    s, e = u.start[rows] - t0, u.end[rows] - t0
    width = int(max(e.max(), s.max()) - min(e.min(), s.min(), 0)) + 1
    off = (it - it.min()).astype(np.int64) * width        # one cumulative max per iteration
    before = np.maximum.accumulate(e + off) - off
    first = u.index[rows] == 0
    begin = np.where(first, s, np.maximum(s, np.r_[s[:1], before[:-1]]))
    return rows, it, begin, e, u.nbytes[rows]


def busy_beside_backward(rs: RankSteps, it: np.ndarray, begin: np.ndarray,
                         end: np.ndarray) -> tuple[float, float, dict[int, list[tuple[float, float]]]]:
    """The comm's busy time (the union of its units in each iteration) beside backward and
    after it, summed over the iterations, in seconds; and each iteration's busy intervals (s
    from its start)."""
    t0 = rs.iterations.start
    spans: dict[int, list[tuple[float, float]]] = {}
    beside = alone = 0.0
    for k in np.unique(it).tolist():
        m = it == k
        iv = sorted(zip((begin[m] / 1e9).tolist(), (end[m] / 1e9).tolist(), strict=True))
        merged: list[list[float]] = []
        for s_, e_ in iv:
            if merged and s_ <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], e_)
            else:
                merged.append([s_, e_])
        spans[k] = [(a, b) for a, b in merged]
        b0 = (rs.backward_start[k] - t0[k]) / 1e9 if rs.backward_start[k] >= 0 else 0.0
        b1 = (rs.backward_end[k] - t0[k]) / 1e9 if rs.backward_end[k] >= 0 else 0.0
        for a, b in merged:
            inside = max(min(b, b1) - max(a, b0), 0.0)
            beside += inside
            alone += (b - a) - inside
    return beside, alone, spans


def layer_profile(rs: RankSteps, sel: np.ndarray) -> tuple[dict[int, float], dict[int, float]]:
    """Per layer: mean backward end from the iteration start (s), and gradient bytes."""
    le = rs.layer_ends
    rows = le.rows(sel)
    layers, inv = np.unique(le.layer[rows], return_inverse=True)
    rel = (le.end[rows] - rs.iterations.start[le.it[rows]]) / 1e9
    mean = np.bincount(inv, weights=rel, minlength=layers.size) / np.maximum(
        np.bincount(inv, minlength=layers.size), 1)
    ready = dict(zip(layers.tolist(), mean.tolist(), strict=True))
    nbytes = dict(rs.layer_bytes)
    if not nbytes and sel.size:  # older traces: split each unit's bytes over its layers
        u = rs.units
        k = int(sel[-1])
        for row in range(int(u.cuts[k]), int(u.cuts[k + 1])):
            layers_ = u.layers(row)
            if layers_ and not math.isnan(u.nbytes[row]):
                for ly in layers_:
                    nbytes[ly] = float(u.nbytes[row]) / len(layers_)
    return ready, nbytes


def idle_waits(rs: RankSteps, sel: np.ndarray, arrivals: np.ndarray) -> dict[int, float]:
    """Per unit index, the mean time (s) the link sat idle inside the unit waiting for the
    last rank to arrive: from when it had the link (its start, or the end of the units
    before it) to that arrival, within the unit."""
    rows, it, begin, end, _ = units_in_iterations(rs, sel)
    if not rows.size:
        return {}
    arrive = arrivals[rows] - rs.iterations.start[it]
    w = np.clip(arrive - begin, 0, np.maximum(end - begin, 0)) / 1e9
    idx = rs.units.index[rows]
    cnt = np.bincount(idx)
    mean = np.bincount(idx, weights=w) / np.maximum(cnt, 1)
    return {i: float(mean[i]) for i in np.flatnonzero(cnt).tolist()}


def unit_timing(rs: RankSteps, sel: np.ndarray, taken: Callable[[int, float], float] | None,
                after_backward: bool = False) -> dict[int, tuple[float, float]]:
    """Per unit index, the means over the iterations `sel` of: its ready time (s from the
    iteration start) on the clock of a backward freed of the measured comm's CPU (`taken`,
    None where it took none: less what the comm busy before it, beside backward, took from
    it: nothing for an iteration's first unit); and its launch delay, the time it started
    after it could (its gradients ready, or backward over where `after_backward` or it was
    ready later, and the units before it in its iteration ended): TensorFlow launches a
    collective some time after backward. Columns, not a loop over the units."""
    u = rs.units
    rows = u.rows(sel)
    if not rows.size:
        return {}
    k = u.it[rows]
    t0 = rs.iterations.start[k]
    ready, start = (u.ready[rows] - t0) / 1e9, (u.start[rows] - t0) / 1e9
    be = rs.backward_end[k]
    bend = np.where(be >= 0, (be - t0) / 1e9, ready)
    # the latest end of the units before each in its iteration (its rows run together)
    e = u.end[rows] - t0
    first = np.concatenate(([True], k[1:] != k[:-1]))
    g = np.cumsum(first) - 1
    lo, width = int(e.min()), int(e.max() - e.min()) + 1
    upto = np.maximum.accumulate(e - lo + g * width) - g * width + lo
    before = np.where(first, -np.inf, np.concatenate(([0], upto[:-1])) / 1e9)
    could = bend if after_backward else np.minimum(ready, bend)
    delay = np.maximum(start - np.maximum(could, before), 0.0)
    at = np.minimum(ready, bend)
    got = ready - (np.array([taken(int(i), t) for i, t in zip(k.tolist(), at, strict=True)])
                   if taken is not None else 0.0)
    idx = u.index[rows]
    order = np.argsort(idx, kind="stable")
    cuts = np.flatnonzero(np.diff(idx[order])) + 1
    out = {}
    for part in np.split(order, cuts):   # each unit index, in the order the units came
        out[int(idx[part[0]])] = (part.min(), float(np.mean(got[part])),
                                  float(np.mean(delay[part])))
    return {i: v[1:] for i, v in sorted(out.items(), key=lambda kv: kv[1][0])}
