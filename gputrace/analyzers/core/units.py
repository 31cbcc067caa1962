"""The comm units of a rank's iterations (DDP's buckets, a job's gradient all-reduces, NCCL
kernels), each with when its gradients were ready and whether it was hidden, and when each
layer's gradients were ready (host spans, or the GPU work launched for them)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gputrace.analyzers.core import overlap as ov
from gputrace.analyzers.core.frame import Spans


@dataclass(frozen=True)
class Units:
    """The comm units (buckets or layers) of every iteration, one row each, sorted by
    iteration and start; times in ns on the trace clock. Rows of iteration k:
    `cuts[k]:cuts[k + 1]`, in launch order (`index`)."""

    it: np.ndarray            # iteration of the row
    index: np.ndarray         # launch order within its iteration
    ready: np.ndarray         # when its gradients were ready (its smallest layer's backward end)
    start: np.ndarray
    end: np.ndarray
    nbytes: np.ndarray        # float, nan when unknown
    hidden: np.ndarray        # ends before the next unit of its iteration is ready
    layer_code: np.ndarray    # into layer_sets
    layer_sets: list[tuple[int, ...] | None]
    cuts: np.ndarray

    def layers(self, row: int) -> tuple[int, ...] | None:
        return self.layer_sets[int(self.layer_code[row])]

    def rows(self, sel: np.ndarray) -> np.ndarray:
        """Indices of the rows in the iterations `sel`."""
        return _rows_in(self.it, sel, self.cuts.size - 1)


@dataclass(frozen=True)
class LayerEnds:
    """When each layer's backward ended in each iteration (its latest span), one row per
    (iteration, layer), sorted by both."""

    it: np.ndarray
    layer: np.ndarray
    end: np.ndarray
    n: int                    # iterations

    def rows(self, sel: np.ndarray) -> np.ndarray:
        return _rows_in(self.it, sel, self.n)

    def lookup(self, it: np.ndarray, layer: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(found, end) for each (iteration, layer) pair."""
        if not self.it.size or not it.size:
            return np.zeros(it.size, dtype=bool), np.zeros(it.size, dtype=np.int64)
        span = int(max(self.layer.max(), layer.max())) + 2
        key = self.it.astype(np.int64) * span + self.layer
        want = it.astype(np.int64) * span + layer
        j = np.clip(np.searchsorted(key, want), 0, key.size - 1)
        return (layer >= 1) & (key[j] == want), self.end[j]


def _rows_in(it: np.ndarray, sel: np.ndarray, n: int) -> np.ndarray:
    m = np.zeros(n, dtype=bool)
    m[sel] = True
    return np.flatnonzero(m[it])


def layer_ends(sp: Spans, mask: np.ndarray, it_of: np.ndarray, n: int,
                end: np.ndarray) -> LayerEnds:
    li = np.flatnonzero(mask)
    li = li[np.lexsort((end[li], sp.layer[li], it_of[li]))]   # latest end last
    it, ly = it_of[li], sp.layer[li]
    last = np.r_[(it[1:] != it[:-1]) | (ly[1:] != ly[:-1]), True] if li.size else \
        np.zeros(0, dtype=bool)
    return LayerEnds(it[last], ly[last], end[li][last], n)


def sorted_rows(sp: Spans, mask: np.ndarray, it_of: np.ndarray, n: int
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Spans of the mask sorted by (iteration, start): indices, cuts, position in iteration."""
    idx = np.flatnonzero(mask)
    idx = idx[np.lexsort((sp.start[idx], it_of[idx]))]
    cuts = np.searchsorted(it_of[idx], np.arange(n + 1), side="left")
    pos = np.arange(idx.size) - cuts[it_of[idx]]
    return idx, cuts, pos


def units(sp: Spans, comm: np.ndarray, host: np.ndarray, it_of: np.ndarray, n: int,
           ends: LayerEnds, back_end: np.ndarray, compute: ov.Union) -> Units:
    ci, cuts, pos = sorted_rows(sp, comm, it_of, n)
    hi_, hcuts, _ = sorted_rows(sp, host, it_of, n)
    k = it_of[ci]
    codes, sets = sp.layer_sets(np.concatenate([ci, hi_]))
    code, hcode = codes[:ci.size], codes[ci.size:]
    if hi_.size:
        # host-side comm spans (the DDP hook's) beside GPU NCCL kernels lend their layers:
        # GPU unit j of an iteration is the hook's unit j when both counts agree
        same = (np.diff(cuts) == np.diff(hcuts))[k]
        borrow = same & np.array([s is None for s in sets])[code]
        code = code.copy()
        code[borrow] = hcode[hcuts[k[borrow]] + pos[borrow]]
    start, end = sp.start[ci], sp.end[ci]
    ready = start.copy()
    # ready when the backward of its smallest layer ends (never after its own start)
    min_layer = np.array([min(s) if s else -1 for s in sets], dtype=np.int64)[code]
    hit, lend = ends.lookup(k, min_layer)
    ready[hit] = np.minimum(lend[hit], start[hit])
    nxt = np.r_[pos[1:] > 0, False]   # the next row is in the same iteration
    hidden = np.zeros(ci.size, dtype=bool)
    hidden[:-1] = nxt[:-1] & (end[:-1] <= ready[1:])
    # and only behind compute, as the overlap of comm with compute counts it: a unit that
    # ends after its iteration's backward did (nothing left to hide it) or that ran mostly
    # outside compute (a synchronous call the job's thread stood in) is exposed
    b = back_end[k] if k.size else np.zeros(0, np.int64)
    covered = ov.measure(compute, start, end)
    hidden &= ((b < 0) | (end <= b)) & (2 * covered >= end - start)
    # iterations, launch places and layer-set codes fit 32 bits: each rank's units are
    # held by the run's analysis until its end (a twelfth of a rank's part less)
    return Units(k.astype(np.int32), pos.astype(np.int32), ready, start, end, sp.nbytes[ci],
                 hidden, code.astype(np.int32), sets, cuts)


def gpu_layer_ends(sp: Spans, per_layer: np.ndarray, bwd_gpu: np.ndarray) -> np.ndarray:
    """The end of each span, except the host's per-layer backward spans: for those, the GPU
    end of the backward records launched while they ran (the layer's gradients exist when
    the GPU has computed them, not when the host launched the work)."""
    out = sp.end
    li = np.flatnonzero(per_layer)
    gi = np.flatnonzero(bwd_gpu & (sp.launch >= 0))
    if not li.size or not gi.size:
        return out
    gi = gi[np.argsort(sp.launch[gi], kind="stable")]
    lt, ge = sp.launch[gi], sp.end[gi]
    a = np.searchsorted(lt, sp.start[li], "left")
    b = np.searchsorted(lt, sp.end[li], "right")
    has = b > a
    out = sp.end.copy()
    if has.any():
        # max over each [a, b): reduceat over the pairs laid side by side, every other one
        pairs = np.column_stack((a[has], b[has])).ravel()
        top = np.maximum.reduceat(np.append(ge, ge[-1]), pairs)[::2]
        out[li[has]] = top
    return out
