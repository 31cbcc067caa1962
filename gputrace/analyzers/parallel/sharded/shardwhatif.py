"""A what-if of the sharded replay: its label, predicted iteration with its interval, and
the settings it changes, or why its figures are withheld."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

RESAMPLES = 200


@dataclass(frozen=True)
class WhatIf:
    label: str
    t_iter: float
    low: float
    high: float
    exposed_s: float
    comm_s: float
    knobs: dict[str, object]
    withheld: str | None = None     # why its figures (then nan) are not given


def mean_ci(v: np.ndarray) -> tuple[float, float, float]:
    """Mean of per-iteration values and its bootstrap 95 % interval (nan below 4)."""
    if v.size < 4:
        return float(np.mean(v)), math.nan, math.nan
    rng = np.random.default_rng(0)
    means = v[rng.integers(0, v.size, (RESAMPLES, v.size))].mean(axis=1)
    return float(np.mean(v)), float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))
