"""The noise of a change between two runs: a 95 % interval of mean(after) - mean(before) from
bootstrap resampling of each run's analyzed iterations, widened by a between-run term.

The between-run term is each run's excursions: the time its iterations spent above the
fence of their own typical figure (the median plus 3.5 robust standard deviations), per
iteration. On a loaded machine these are the stalls (a preempted process: 3-8 ms landing
in one phase of some iterations) whose number follows the machine's load at the time of the
recording, not the job: two recordings of one job had them in 9 of 17 iterations and in
none. Resampling one run's iterations keeps its stall count; the term lets each run's
excursion time be anywhere from none to twice what it was (a normal of that standard
deviation, the two runs' added in quadrature). A change made in every iteration is beside
the excursions and keeps its interval; one made in a few iterations only is counted as
possibly the machine's (docs/diff.md).

Where both recordings measured the time the job was runnable and waiting for a CPU (the
host collector's `proc.run_wait_s`), that wait measures the machine's load on the job
itself (a stall is such a wait, and so is every sleep's late wake-up on a loaded machine,
which is no excursion): the iteration's interval then holds its change at the same load as
well as the change measured, and its excursions are left out."""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

RESAMPLES = 2000
SEED = 0
METHOD = "bootstrap+excursions"
FENCE = 3.5           # robust standard deviations above the median
# runs per side that put the drift between runs in the interval (analyzers.compare.diff_runs): 2
# give a variance, 3 interleaved are what bench/diff_aa.py measured the false alarms with
RUNS_FOR_DRIFT = 3


class Noise(NamedTuple):
    low: float
    high: float
    between_s: float      # the between-run term's standard deviation in the interval


def excursions(x: np.ndarray) -> np.ndarray:
    """Per iteration, its time above the fence of the run's typical iteration: the median
    plus 3.5 robust standard deviations (1.4826 median absolute deviations; the modified
    z-score's outlier rule, Iglewicz and Hoaglin). Median and deviation hold while fewer than
    half the iterations stall. 0 with fewer than 4 iterations."""
    x = np.asarray(x, float)
    if x.size < 4:
        return np.zeros(x.size)
    med = float(np.median(x))
    mad = float(np.median(np.abs(x - med)))
    return np.maximum(x - (med + FENCE * 1.4826 * mad), 0.0)


def between(ex_x: np.ndarray, ex_y: np.ndarray) -> float:
    """The between-run term's standard deviation: each run's mean excursion, in quadrature."""
    mx = float(np.mean(ex_x)) if np.size(ex_x) else 0.0
    my = float(np.mean(ex_y)) if np.size(ex_y) else 0.0
    return float(np.hypot(mx, my))


def interval(x: np.ndarray, y: np.ndarray, seed: int = SEED,
             ex_x: np.ndarray | None = None, ex_y: np.ndarray | None = None
             ) -> Noise | None:
    """95 % interval of mean(y) - mean(x): each run's iterations resampled on its own, plus
    the between-run term of their excursions (`ex_x`, `ex_y`: per iteration, by default
    each series' own). None with fewer than 2 iterations on a side."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    if x.size < 2 or y.size < 2:
        return None
    rng = np.random.default_rng(seed)
    mx = x[rng.integers(0, x.size, (RESAMPLES, x.size))].mean(axis=1)
    my = y[rng.integers(0, y.size, (RESAMPLES, y.size))].mean(axis=1)
    sd = between(excursions(x) if ex_x is None else ex_x,
                 excursions(y) if ex_y is None else ex_y)
    d = my - mx + (rng.normal(0.0, sd, RESAMPLES) if sd > 0 else 0.0)
    lo, hi = np.percentile(d, [2.5, 97.5])
    return Noise(float(lo), float(hi), sd)


def iteration_excursions(terms: dict[str, np.ndarray], leaves: tuple[str, ...]
                         ) -> np.ndarray:
    """The iteration's excursions: per iteration, the larger of its own and the sum of its
    terms' (`leaves`), as a stall in one short phase is hidden in the iteration's own spread
    when that is wide."""
    it = terms["t_iter"]
    parts = [excursions(terms[k]) for k in leaves if k in terms and terms[k].size == it.size]
    return np.maximum(excursions(it), np.sum(parts, axis=0) if parts else 0.0)


def net_of_wait(ci: Noise | None, t_x: float, t_y: float, wait_x: float | None,
                wait_y: float | None) -> Noise | None:
    """The iteration's interval stretched to hold also its change at the same load: each
    run's iteration less its wait for a CPU (`wait_x`, `wait_y` per iteration) is what it
    took with the machine to itself; the run after, stretched by the load the run before
    had (t_x over its time without the wait), less t_x. Beyond noise only where the change
    is, with and without the load's difference. None of the wait: as it was."""
    if ci is None or wait_x is None or wait_y is None:
        return ci
    own_x, own_y = t_x - wait_x, t_y - wait_y
    if own_x <= 0 or own_y <= 0:
        return ci
    d = (t_x * own_y / own_x - t_x) - (t_y - t_x)   # same-load change less the measured
    return Noise(min(ci.low, ci.low + d), max(ci.high, ci.high + d), ci.between_s)


def put_interval(r: dict[str, Any], ci: Noise | None) -> None:
    """A row's `low`, `high`, `beyond_noise` and `between_s` from its interval `ci`
    (None: none known)."""
    r.update({"low": ci.low if ci else None, "high": ci.high if ci else None,
              "beyond_noise": ci is not None and (ci.low > 0 or ci.high < 0),
              "between_s": ci.between_s if ci else None})
