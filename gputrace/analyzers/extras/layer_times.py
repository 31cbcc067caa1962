"""Each layer's measured forward and backward time per analyzed iteration of one rank, that
the FLOP count's layers are divided by (analyzers.extras.flops.layers): from the rank's own
spans as its part of the analysis reads them (`of_spans`), or from the columns of a table
read beside it (analysis.document_flops, for inputs the analysis did not read rank by rank).

A span belongs to the iterations from the first analyzed one's start to the last one's end;
a forward that ran inside a backward pass (a checkpointed layer's forward recomputed there)
is the backward's work, not the layer's forward, and is left out; so is the iteration whose
FLOPs were counted where the timings leave it out (`left`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from gputrace.analyzers.core import overlap as ov

if TYPE_CHECKING:
    from gputrace.analyzers.core.frame import Spans

Times = dict[int, tuple[float | None, float | None]]


def layer_times(start: np.ndarray, end: np.ndarray, layer: np.ndarray, fwd: np.ndarray,
                bwd: np.ndarray, names: Callable[[np.ndarray], list[str]], its: np.ndarray,
                outer: np.ndarray, skipped: int, left: tuple[int, int] | None = None
                ) -> Times:
    """layer -> (forward, backward) seconds per iteration (None where it has none) of the
    rows `start`, `end`, `layer` (arrays of one length) of which `fwd` and `bwd` (masks)
    are the forward and backward spans that count, `its` the rank's iterations (of which
    the first `skipped` are warm-up), `outer` its backward passes (layer < 0); `names`:
    the names of some rows (their indices), whose times are summed name by name before
    layer by layer; `left`: the counted iteration's [start, end), left out."""
    first = np.sort(start[its])[skipped:]
    ok = None
    if left is not None:
        first = first[(first < left[0]) | (first >= left[1])]
        ok = (start < left[0]) | (start >= left[1])
    if not first.size:
        return {}
    last = int(end[its].max())
    if ok is not None:
        outer = outer & ok
    inside = np.zeros(start.size, bool)
    if outer.any():
        lo, hi = ov.union(start[outer], end[outer])
        j = np.searchsorted(lo, start, side="right") - 1
        inside = (j >= 0) & (start < hi[np.clip(j, 0, None)])
    m = (start >= first[0]) & (end <= last) & (layer >= 0) & ((fwd & ~inside) | bwd)
    if ok is not None:
        m &= ok
    n = first.size
    out: dict[int, list[float | None]] = {}
    for i, which in enumerate((fwd, bwd)):
        idx = np.flatnonzero(m & which)
        dur = ((end[idx] - start[idx]) / 1e9).tolist()
        per: dict[tuple[int, str], float] = {}       # (layer, name) -> its time per iteration
        for key, d in zip(zip(layer[idx].tolist(), names(idx), strict=True), dur, strict=True):
            per[key] = per.get(key, 0.0) + d / n
        for (ly, _), v in per.items():
            cur = out.setdefault(ly, [None, None])
            cur[i] = (cur[i] or 0.0) + v
    return {ly: (c[0], c[1]) for ly, c in out.items()}


def of_spans(sp: Spans, skipped: int, left: tuple[int, int] | None = None) -> Times:
    """layer_times of one rank's spans."""
    it = sp.names.index("iteration") if "iteration" in sp.names else -2
    bwd = sp.of("backward")
    return layer_times(sp.start, sp.end, sp.layer, sp.of("forward"), bwd,
                       lambda idx: [sp.names[c] for c in sp.name[idx].tolist()],
                       sp.of("iteration") & (sp.name == it), bwd & (sp.layer < 0), skipped,
                       left)
