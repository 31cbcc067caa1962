"""Which ranks stand out from the others, and why. No I/O."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# the terms a rank's extra time is put down to (t_comm is all comm time, hidden or not:
# its exposed part is what delays the iteration)
WHY_TERMS = (("t_io", "waiting for data"), ("t_h2d", "host-to-device copies"),
             ("t_f", "forward"), ("t_b", "backward"), ("t_u", "update"),
             ("comm_exposed", "exposed gradient comm"), ("t_other", "time in no phase"))
MIN_EXCESS = 0.05        # an outlier is at least this much slower than the median rank
ROBUST_Z = 3.5           # ... and this many robust standard deviations above it


@dataclass(frozen=True)
class Outlier:
    rank: int
    host: str
    t_iter_s: float
    excess_s: float          # over the median rank's t_iter
    term: str                # the term that grew most over its median across ranks
    term_excess_s: float
    why: str


def _why(rank: int, figures: dict[int, dict[str, float]], median: dict[str, float]
         ) -> tuple[str, float, str]:
    excess = {k: figures[rank][k] - median[k] for k, _ in WHY_TERMS}
    term = max(excess, key=lambda k: excess[k])
    label = dict(WHY_TERMS)[term]
    return term, excess[term], f"{label} +{excess[term] * 1e3:.1f} ms over the median rank"


def find_outliers(figures: dict[int, dict[str, float]], hosts: dict[int, str]
                  ) -> tuple[list[Outlier], Outlier | None]:
    """Ranks whose iteration is slower than the median rank's by at least 5 % and 3.5
    robust standard deviations, slowest first, each with the term that grew most; and the
    slowest rank told the same way (None with fewer than two ranks). `figures`: per rank,
    t_iter and the WHY_TERMS in seconds per iteration."""
    if len(figures) < 2:
        return [], None
    ranks = sorted(figures)
    t = np.array([figures[r]["t_iter"] for r in ranks])
    med_t = float(np.median(t))
    mad = 1.4826 * float(np.median(np.abs(t - med_t)))
    median = {k: float(np.median([figures[r][k] for r in ranks])) for k, _ in WHY_TERMS}

    def told(r: int) -> Outlier:
        term, ex, why = _why(r, figures, median)
        return Outlier(r, hosts.get(r, ""), figures[r]["t_iter"],
                       figures[r]["t_iter"] - med_t, term, ex, why)

    out = [told(r) for r, x in zip(ranks, t, strict=True)
           if x - med_t >= max(MIN_EXCESS * med_t, ROBUST_Z * mad) and x > med_t]
    out.sort(key=lambda o: -o.t_iter_s)
    slowest = max(ranks, key=lambda r: figures[r]["t_iter"])
    return out, told(slowest)
