"""Two runs' whole-run time compared: the goodput and each badput category before and after
(analyzers.extras.goodput), the shown rank of each side; with several runs a side, each figure the
mean of its side's runs and its change's interval across the runs (analyzers.compare.diff_runs)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from gputrace.analyzers.compare.diff_noise import Noise, put_interval
from gputrace.analyzers.core.results import RankAnalysis
from gputrace.analyzers.extras.goodput import CATEGORIES, WITHHELD, Goodput

Interval = Callable[[Sequence[float], Sequence[float]], Noise | None]


def _side(ras: Sequence[RankAnalysis]) -> list[Goodput] | None:
    """Each run's goodput; None where a run has none (recorded before it,
    imported) or withheld it."""
    out = [r.goodput for r in ras]
    if any(g is None for g in out) or any(WITHHELD in r.withheld for r in ras):
        return None
    return out  # type: ignore[return-value]


def goodput(b: RankAnalysis, a: RankAnalysis) -> dict[str, Any] | None:
    """Per category (and the training steps, and the wall time) its seconds before and
    after and the change; one value per run, so no noise interval (`low`, `high` null).
    None where either run has no goodput (recorded before it, imported) or
    withheld it."""
    return goodput_runs([b], [a], lambda x, y: None)


def goodput_runs(before: Sequence[RankAnalysis], after: Sequence[RankAnalysis],
                 interval: Interval) -> dict[str, Any] | None:
    """As `goodput`, of two sides of runs: each figure the mean of its side's runs (a
    share the mean of the runs' shares), each change with `interval(x, y)` of the runs'
    figures (its `low`, `high`, `beyond_noise`, `between_s`: diff_noise.put_interval)."""
    gb, ga = _side(before), _side(after)
    if gb is None or ga is None:
        return None

    def row(fig: Callable[[Goodput], float], share: bool = True) -> dict[str, Any]:
        x, y = [fig(g) for g in gb], [fig(g) for g in ga]
        mx, my = float(np.mean(x)), float(np.mean(y))
        r: dict[str, Any] = {"before": mx, "after": my, "change": my - mx}
        if share:
            r.update({f"share_{k}": _mean_share(side, fig)
                      for k, side in (("before", gb), ("after", ga))})
        put_interval(r, interval(x, y))
        return r

    cats = {"training": row(lambda g: g.training_s)}
    cats.update({k: row(lambda g, k=k: g.badput_s[k]) for k in CATEGORIES})  # type: ignore[misc]
    return {"goodput": row(lambda g: g.goodput, share=False),
            "wall_s": row(lambda g: g.wall_s, share=False),
            "categories": cats,
            "runs": {"before": len(gb), "after": len(ga)},
            # a windowed side: its stalls outside the window (a data wait or other work not
            # told apart there); a side with a run that never closed (killed, recovered)
            "stalls_outside_window_s": {
                k: float(np.mean([g.stalls_outside_window_s for g in side]))
                for k, side in (("before", gb), ("after", ga))},
            "not_closed": {k: sum(g.ends_at == "last_record" for g in side)
                           for k, side in (("before", gb), ("after", ga))},
            "evaluation": {"before": _mean_dict([g.evaluation for g in gb]),
                           "after": _mean_dict([g.evaluation for g in ga])},
            "checkpoint": {"before": _mean_dict([g.checkpoint for g in gb]),
                           "after": _mean_dict([g.checkpoint for g in ga])}}


def _mean_dict(ds: list[dict[str, float]]) -> dict[str, float | None]:
    """Each key's mean over the runs (None where a run lacks it or holds none)."""
    keys = list(dict.fromkeys(k for d in ds for k in d))
    out: dict[str, float | None] = {}
    for k in keys:
        vals = [d.get(k) for d in ds]
        out[k] = None if any(v is None for v in vals) else float(np.mean(vals))  # type: ignore[arg-type]
    return out


def _mean_share(side: list[Goodput], fig: Callable[[Goodput], float]) -> float | None:
    shares = [fig(g) / g.wall_s for g in side if g.wall_s > 0]
    return float(np.mean(shares)) if len(shares) == len(side) else None
