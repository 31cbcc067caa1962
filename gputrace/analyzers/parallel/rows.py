"""The comm rows of one dimension issued inside the analyzed iterations."""

from __future__ import annotations

import numpy as np

from gputrace.analyzers.core.collectives import Rows
from gputrace.analyzers.core.frame import Spans


def rows_in(sp: Spans, r: Rows, dim: str, it_start: np.ndarray, it_end: np.ndarray,
            sel: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(j, it): the indices into r of the rows of `dim` that start inside an iteration of
    `sel`, and that iteration, in row order."""
    j = np.flatnonzero(np.array([d == dim for d in r.dim], bool))
    if not j.size or not sel.size:
        return j[:0], j[:0]
    t = sp.start[r.idx[j]]
    it = np.searchsorted(it_start, t, side="right") - 1
    ok = (it >= 0) & np.isin(it, sel)
    ok[ok] &= t[ok] < it_end[it[ok]]
    return j[ok], it[ok]
