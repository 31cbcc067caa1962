"""Two sides of several runs each (the same job recorded N times, before and after a change):
every mean's change with a 95 % interval from the runs themselves, so that what moves from
one run of unchanged code to the next (the machine's drift, another node, a slower start) is
in it, beside what moves from iteration to iteration.

Each run gives one figure per row (its mean iteration, a term, a layer's time, a comm
unit's, a collective kind's, a rank's, a kernel's); a side's figure is the mean of its
runs'. Where the runs were made in pairs, interleaved (A B, B A, A B ..., as `gputrace
record --repeat N --interleave` makes them, told by when each run started), the interval is
Student's t on the pairs' differences: what the machine did to both runs of a pair cancels,
what it did between pairs is in the differences' spread. Otherwise it is Welch's: the
difference of the two sides' means, plus or minus the t quantile (Welch-Satterthwaite
degrees of freedom) times the standard error made of each side's variance across its runs.
A run's mean already holds its iterations' spread, and the variance between the runs holds
that and the drift, so nothing of one run alone (its stalls, its wait for a CPU) is added.
With one run on a side and several on the other, the side of several gives the variance of
both (equal variances: a run is a run). A change the job makes itself (more loader
workers, and the CPUs they take) is in every run of its side, in the difference of the
means, not in the variance."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from gputrace.analyzers import Analysis, RankAnalysis
from gputrace.analyzers.compare import diff_goodput
from gputrace.analyzers.compare.diff import (
    TERMS,
    TOP,
    _mean,
    change,
    compare,
    headline,
    kind_rows,
    model,
    put_interval,
    rank_rows,
    terms_only,
    unit_rows,
    units_match,
)
from gputrace.analyzers.compare.diff_noise import RESAMPLES, RUNS_FOR_DRIFT, SEED, Noise
from gputrace.analyzers.compare.diff_parts import Parts

METHOD = "runs+welch"
PAIRED = "runs+paired"      # the runs made in pairs, interleaved


class Run(NamedTuple):
    analysis: Analysis
    rank: int           # the rank compared
    parts: Parts


@functools.lru_cache(maxsize=256)
def t_quantile(df: float) -> float:
    """The 97.5th percentile of Student's t with `df` degrees of freedom (`df` rounded to
    0.01), from numpy's t sampler with a fixed seed (within 0.5 % for df >= 1)."""
    rng = np.random.default_rng(SEED)
    return float(np.percentile(rng.standard_t(max(df, 1.0), 100 * RESAMPLES), 97.5))


def welch(x: Sequence[float], y: Sequence[float]) -> Noise | None:
    """95 % interval of mean(y) - mean(x) from the runs' figures (Welch); `between_s`: its
    standard error. None with one run on both sides."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    if x.size + y.size < 3 or min(x.size, y.size) < 1:
        return None
    d = float(y.mean() - x.mean())
    if x.size < 2 or y.size < 2:    # one side of one run: the other's variance for both
        many = x if x.size > 1 else y
        se = float(np.std(many, ddof=1) * np.sqrt(1 / x.size + 1 / y.size))
        df = float(many.size - 1)
    else:
        vx, vy = np.var(x, ddof=1) / x.size, np.var(y, ddof=1) / y.size
        se = float(np.sqrt(vx + vy))
        den = vx**2 / (x.size - 1) + vy**2 / (y.size - 1)
        df = float((vx + vy) ** 2 / den) if den > 0 else float(x.size + y.size - 2)
    half = t_quantile(round(df, 2)) * se
    return Noise(d - half, d + half, se)


def paired(x: Sequence[float], y: Sequence[float]) -> Noise | None:
    """95 % interval of mean(y - x) over runs made in pairs (x[i] beside y[i], interleaved):
    Student's t on the pairs' differences, what the machine did to both runs of a pair
    cancelling; `between_s`: its standard error. None with fewer than 2 pairs."""
    d = np.asarray(y, float) - np.asarray(x, float)
    if d.size < 2:
        return None
    se = float(np.std(d, ddof=1) / np.sqrt(d.size))
    half = t_quantile(float(d.size - 1)) * se
    m = float(d.mean())
    return Noise(m - half, m + half, se)


def interleaved(before: list[Run], after: list[Run]) -> list[tuple[int, int]] | None:
    """The runs' pairs (index before, index after) where the two sides have as many runs,
    2 or more, recorded in pairs (A B, B A, A B, ..., as `gputrace record --repeat N
    --interleave` makes them, or A B A B ...): in time order, each two runs one of each
    side. None otherwise, or where a run does not say when it started."""
    if len(before) != len(after) or len(before) < 2:
        return None
    try:
        at = [(int(r.analysis.metadata["start"]["realtime_ns"]), side, i)
              for side, runs in ((0, before), (1, after)) for i, r in enumerate(runs)]
    except (KeyError, TypeError, ValueError):
        return None
    at.sort()
    if any(at[k][1] == at[k + 1][1] for k in range(0, len(at), 2)):
        return None
    return [(at[k][2], at[k + 1][2]) if at[k][1] == 0 else (at[k + 1][2], at[k][2])
            for k in range(0, len(at), 2)]


Pairs = list[tuple[int, int]] | None


def median_run(t_iter: Sequence[float]) -> int:
    """The index of a side's median run: the one whose mean iteration is the middle of its
    runs' (of an even number, the lower of the two middle ones), the run a page draws as
    the side's."""
    return int(np.argsort(np.asarray(t_iter, float), kind="stable")[(len(t_iter) - 1) // 2])


def runs_interval(x: Sequence[float], y: Sequence[float], pairs: Pairs) -> Noise | None:
    """The interval of a row's change across the runs: paired where the runs were made in
    pairs, else Welch's."""
    if pairs is None:
        return welch(x, y)
    return paired([x[i] for i, _ in pairs], [y[j] for _, j in pairs])


Rows = dict[str, dict[str, float]]


def _side_rows(runs: list[Rows]) -> tuple[Rows, dict[str, list[float]]]:
    """A side's rows: each name's figures averaged over the runs (a run without the name:
    0), and each name's `time_s` in every run."""
    names = list(dict.fromkeys(n for r in runs for n in r))
    out: Rows = {}
    per: dict[str, list[float]] = {}
    for n in names:
        figs = list(dict.fromkeys(f for r in runs if n in r for f in r[n]))
        row: dict[str, float] = {}
        for f in figs:
            vals = [r[n].get(f, 0.0) if n in r else 0.0 for r in runs]
            row[f] = None if any(v is None for v in vals) else float(np.mean(vals))  # type: ignore[assignment]
        out[n] = row
        per[n] = [float(r[n].get("time_s") or 0.0) if n in r else 0.0 for r in runs]
    return out, per


def named_runs(before: list[Rows], after: list[Rows], pairs: Pairs = None) -> dict[str, Any]:
    """A matched table (analyzers.compare.diff.named's keys) of the runs' rows: the top changes of
    `time_s`, each with its interval across the runs."""
    (b, pb), (a, pa) = _side_rows(before), _side_rows(after)
    both = [{"name": n, **{f"{f}_before": b[n][f] for f in b[n]},
             **{f"{f}_after": a[n][f] for f in a[n]},
             "change": (a[n].get("time_s") or 0.0) - (b[n].get("time_s") or 0.0)}
            for n in b if n in a]
    both.sort(key=lambda r: -abs(r["change"]))
    top = both[:TOP]
    for r in top:
        put_interval(r, runs_interval(pb[r["name"]], pa[r["name"]], pairs))
    return {"matched": len(both), "top": top,
            "only_before": sorted(n for n in b if n not in a),
            "only_after": sorted(n for n in a if n not in b)}


def breakdown_runs(before: list[RankAnalysis], after: list[RankAnalysis], pairs: Pairs = None
                   ) -> dict[str, dict[str, Any]]:
    """Each term's change: the runs' means, the interval across the runs."""
    out: dict[str, dict[str, Any]] = {}
    for k, label in TERMS:
        vb, va = ([_mean(r, k) for r in side] for side in (before, after))
        if all(v is None for v in vb + va):
            continue
        xb, xa = ([v or 0.0 for v in vs] for vs in (vb, va))
        mb_, ma = float(np.mean(xb)), float(np.mean(xa))
        if k != "t_iter" and mb_ == 0 and ma == 0:
            continue
        out[k] = {"label": label, **change(mb_, ma, runs_interval(xb, xa, pairs))}
    return out


def _rows(runs: list[Run], what: str) -> list[Rows]:
    if what in ("forward", "backward", "kernels"):
        return [getattr(r.parts, what) for r in runs]
    if what == "units":
        return [unit_rows(r.analysis.ranks[r.rank])[0] for r in runs]
    if what == "collectives":
        return [kind_rows(r.analysis.ranks[r.rank]) for r in runs]
    return [rank_rows(r.analysis) for r in runs]


def _mean_of(values: list[Any]) -> Any:
    vals = [v for v in values if v is not None and v == v]
    return float(np.mean(vals)) if len(vals) == len(values) and vals else None


def _model(runs: list[Run]) -> dict[str, Any]:
    ms = [model(r.analysis.ranks[r.rank]) for r in runs]
    out = dict(ms[0])
    for k in ("predicted_t_iter", "measured_t_iter"):
        out[k] = _mean_of([m[k] for m in ms])
    out["speedup"] = {g: _mean_of([m["speedup"].get(g) for m in ms]) for g in ms[0]["speedup"]}
    return out


def _rate(values: list[Any]) -> float | None:
    """A side's rate: the harmonic mean of its runs' (the batch over the runs' mean
    iteration, as the side's t_iter is their mean)."""
    vals = [v for v in values if v]
    return len(vals) / sum(1 / v for v in vals) if vals and len(vals) == len(values) else None


def _throughput(before: list[Run], after: list[Run]) -> dict[str, Any] | None:
    tb, ta = ([r.analysis.throughput for r in side] for side in (before, after))
    if any(t is None for t in tb + ta):
        return None
    out: dict[str, Any] = {}
    for k in ("samples_per_s", "tokens_per_s"):
        b, a = (_rate([getattr(t, k) for t in side]) for side in (tb, ta))
        if b is None or a is None:
            continue
        out[k] = {"before": b, "after": a, "ratio": a / b if b else None}
    return out or None


def _ranks(before: list[Run], after: list[Run], pairs: Pairs) -> dict[str, Any]:
    d = named_runs(_rows(before, "ranks"), _rows(after, "ranks"), pairs)

    def slowest(side: list[Run]) -> int:
        means = _side_rows(_rows(side, "ranks"))[0]
        return int(max(means, key=lambda r: means[r]["time_s"]))

    sb, sa = ({o.rank for r in side for o in r.analysis.outliers} for side in (before, after))
    return {"slowest_before": slowest(before), "slowest_after": slowest(after),
            "stragglers_before": sorted(sb), "stragglers_after": sorted(sa),
            "stragglers_appeared": sorted(sa - sb), "stragglers_gone": sorted(sb - sa), **d}


def compare_runs(before: list[Run], after: list[Run]) -> dict[str, Any]:
    """The diff document (analyzers.compare.diff.compare's keys) of two sides of runs, at least one
    of them of two or more: every figure the mean of its side's runs, every interval
    across the runs (`noise.method` `runs+welch`). What the runs' metadata says and whether
    their layers match come from the first run of each side."""
    b0, a0 = before[0], after[0]
    doc = compare(b0.analysis, a0.analysis, b0.rank, a0.rank, b0.parts, a0.parts)
    rb = [r.analysis.ranks[r.rank] for r in before]
    ra = [r.analysis.ranks[r.rank] for r in after]
    pairs = interleaved(before, after)
    terms = breakdown_runs(rb, ra, pairs)
    layers = {ph: named_runs(_rows(before, ph), _rows(after, ph), pairs)
              for ph in ("forward", "backward")}
    unit = named_runs(_rows(before, "units"), _rows(after, "units"), pairs)
    unit["units_match"] = units_match(rb[0], ra[0], unit)
    why = []
    for what, d in (("layers", layers["backward"]), ("comm units", unit)):
        if (d["only_before"] or d["only_after"]) and d.get("units_match") is not True:
            why.append(f"{what} do not match ({len(d['only_before'])} only before, "
                       f"{len(d['only_after'])} only after, {d['matched']} in both)")
    t = [[float(r.breakdown["t_iter"].mean) for r in side] for side in (rb, ra)]
    doc.update({
        "headline": headline(terms), "breakdown": terms, "terms_only": terms_only(terms),
        "noise": {"method": METHOD if pairs is None else PAIRED, "resamples": None,
                  "confidence": 0.95, "paired": pairs is not None,
                  "excursions_s": {"before": None, "after": None},
                  "run_wait_s": {"before": None, "after": None},
                  "run_wait_own_s": {"before": None, "after": None},
                  "runs": {"before": len(before), "after": len(after)},
                  "drift_in_interval": True, "runs_for_drift": RUNS_FOR_DRIFT,
                  "t_iter_runs": {"before": t[0], "after": t[1]}},
        "comparable": not why, "not_comparable": "; ".join(why) or None,
        "iterations": {"before": sum(r.iterations - r.warmup_skipped for r in rb),
                       "after": sum(r.iterations - r.warmup_skipped for r in ra)},
        "layers": layers, "units": unit,
        "collectives": named_runs(_rows(before, "collectives"), _rows(after, "collectives"),
                                  pairs),
        "ranks": _ranks(before, after, pairs),
        "kernels": named_runs(_rows(before, "kernels"), _rows(after, "kernels"), pairs),
        "model": {"before": _model(before), "after": _model(after)},
        "throughput": _throughput(before, after),
        "goodput": diff_goodput.goodput_runs(rb, ra,
                                             lambda x, y: runs_interval(x, y, pairs))})
    return doc
