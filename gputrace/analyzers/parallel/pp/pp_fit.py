"""A pipeline's replay fitted to its measured step: the transfer time between stages, and
the schedule's own work per microbatch where the replay with it alone outlasts the step, so
that replaying the measured configuration gives the measured step (pp.combine); the
what-ifs (pp_whatif) replay other configurations with them. With runs at several
microbatch counts (`--calibrate`): a time per microbatch as a + b/m through two of them
(line, piecewise), and the schedule's own work and the transfer at another count (rest_at)."""

from __future__ import annotations

from gputrace.analyzers.parallel.pp import pipesim, pporders


def fit(lay: pporders.Layout, fwd: list[float], bwd: list[float], wgt: list[float],
        loss: float, measured: float) -> float:
    """The transfer time with which replaying `lay` gives the measured makespan (0 when
    even none gives more)."""
    def span(t: float) -> float:
        return pipesim.run(lay.orders, lay.rank_of, fwd, bwd, wgt, t, loss).makespan

    if span(0.0) >= measured:
        return 0.0
    lo, hi = 0.0, measured
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if span(mid) < measured else (lo, mid)
    return (lo + hi) / 2


def fit_own(lay: pporders.Layout, fwd: list[float], bwd: list[float], wgt: list[float],
            own: list[tuple[float, float]], loss: float, measured: float
            ) -> tuple[list[tuple[float, float]], float]:
    """The schedule's own work per microbatch and the transfer time with which replaying
    `lay` (each forward and backward with its own work) gives the measured makespan: the
    own work as measured and the transfer fitted to the rest, or, where the replay with
    the own work alone outlasts the step, the own work scaled down to give it and no
    transfer."""
    def with_(k: float) -> tuple[list[float], list[float]]:
        return ([f + k * o for f, (o, _) in zip(fwd, own, strict=True)],
                [b + k * o for b, (_, o) in zip(bwd, own, strict=True)])

    def span(k: float) -> float:
        f, b = with_(k)
        return pipesim.run(lay.orders, lay.rank_of, f, b, wgt, 0.0, loss).makespan

    if not any(o for pair in own for o in pair) or span(1.0) <= measured:
        f, b = with_(1.0)
        return list(own), fit(lay, f, b, wgt, loss, measured)
    lo, hi = 0.0, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if span(mid) < measured else (lo, mid)
    k = (lo + hi) / 2
    return [(k * a, k * b) for a, b in own], 0.0


# a run's schedule at its microbatch count: (m, per stage its own work per microbatch
# (forward, backward), the fitted transfer)
Rest = tuple[int, tuple[tuple[float, float], ...], float]


def rest_at(points: tuple[Rest, ...], m: int) -> tuple[list[tuple[float, float]], float]:
    """Each stage's own work per microbatch and the transfer at m, through the two runs
    (`points`, m ascending, two or more) whose counts lie nearest m, the nearest two beyond
    them outside: on the line a + b/m through the two, never below 0, so that at a measured
    count they are that run's."""
    j = 1
    while j < len(points) - 1 and points[j][0] < m:
        j += 1
    (m0, o0, t0), (m1, o1, t1) = points[j - 1], points[j]

    def on(x0: float, x1: float) -> float:
        b = (x0 - x1) / (1 / m0 - 1 / m1)
        return max(x0 + b * (1 / m - 1 / m0), 0.0)
    return ([(on(f0, f1), on(b0, b1)) for (f0, b0), (f1, b1) in zip(o0, o1, strict=True)],
            on(t0, t1))


def piecewise(points: tuple[tuple[int, tuple[float, ...], tuple[float, ...], float], ...],
              m: int) -> tuple[list[float], list[float], float]:
    """Each stage's times at m through the two measured counts around m (the nearest two
    beyond the measured ones)."""
    ms = [q[0] for q in points]
    j = 1
    while j < len(ms) - 1 and ms[j] < m:
        j += 1
    lo, hi = points[j - 1], points[j]

    def f(t0: float, t1: float) -> float:
        a, b = line(t0, lo[0], t1, hi[0])
        return a + b / m
    return ([f(x, y) for x, y in zip(lo[1], hi[1], strict=True)],
            [f(x, y) for x, y in zip(lo[2], hi[2], strict=True)], f(lo[3], hi[3]))


def line(t0: float, m0: int, t1: float, m1: int) -> tuple[float, float]:
    """(a, b) of t = a + b/m through (m0, t0) and (m1, t1); a and b never negative (a
    run whose smaller microbatches cost less per sample is taken as proportional to the
    size, a smaller microbatch that costs more in all as fixed)."""
    b = (t0 - t1) / (1 / m0 - 1 / m1)
    a = t0 - b / m0
    if b < 0:
        return t0, 0.0
    if a < 0:
        return 0.0, t0 * m0
    return a, b
