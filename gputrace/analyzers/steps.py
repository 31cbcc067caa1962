"""Iterations, the per-iteration t_io/t_h2d/t_f/t_b/t_u/t_comm breakdown, hidden vs exposed
comm and I/O, and the comm units (buckets or layers) of each iteration."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import numpy as np

from gputrace.analyzers import overlap as ov
from gputrace.analyzers.frame import Spans

TERMS = ("t_iter", "t_io", "t_h2d", "t_f", "t_b", "t_u", "t_comm", "t_other")


@dataclass(frozen=True)
class Iterations:
    start: np.ndarray
    end: np.ndarray
    step: np.ndarray
    synthetic: bool          # no iteration spans: the whole window is one iteration
    loop: tuple[int, int]    # (pid, tid) of the training loop


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


def _layer_ends(sp: Spans, mask: np.ndarray, it_of: np.ndarray, n: int) -> LayerEnds:
    li = np.flatnonzero(mask)
    li = li[np.lexsort((sp.end[li], sp.layer[li], it_of[li]))]   # latest end last
    it, ly = it_of[li], sp.layer[li]
    last = np.r_[(it[1:] != it[:-1]) | (ly[1:] != ly[:-1]), True] if li.size else \
        np.zeros(0, dtype=bool)
    return LayerEnds(it[last], ly[last], sp.end[li][last], n)


@dataclass(frozen=True)
class RankSteps:
    rank: int
    iterations: Iterations
    terms: dict[str, np.ndarray]      # seconds per iteration
    comm: ov.Hidden
    io: ov.Hidden
    units: Units
    layer_backward_s: list[dict[int, float]]   # per iteration: layer -> backward seconds
    layer_ends: LayerEnds
    layer_bytes: dict[int, float]     # layer -> gradient bytes (host backward spans' bytes)
    backward_start: np.ndarray        # ns, per iteration (-1 when none)
    backward_end: np.ndarray          # ns, per iteration (-1 when none)
    fetch_s: np.ndarray               # mean loader fetch per batch, seconds (nan: none)
    loader_workers: int
    update_spans: np.ndarray          # update spans per iteration


def warmup_skip(n: int, skip: int | None = None) -> int:
    """Iterations to leave out: the first 10% or the first 3, keeping at least half."""
    if skip is not None:
        return max(0, min(skip, n - 1)) if n else 0
    return min(max(math.ceil(0.1 * n), 3), n // 2)


def find_iterations(sp: Spans) -> Iterations:
    m = sp.of("iteration")
    if m.any():
        idx = np.flatnonzero(m)
        idx = idx[np.argsort(sp.start[idx], kind="stable")]
        loop = Counter(zip(sp.pid[idx].tolist(), sp.tid[idx].tolist(), strict=True)).most_common(1)[0][0]
        return Iterations(sp.start[idx], sp.end[idx], sp.step[idx], False, loop)
    lo = int(sp.start.min())
    hi = int(max(sp.end.max(), sp.start.max()))
    c = Counter(zip(sp.pid.tolist(), sp.tid.tolist(), strict=True)).most_common(1)[0][0]
    return Iterations(np.array([lo]), np.array([hi]), np.array([0]), True, c)


def _u(sp: Spans, mask: np.ndarray) -> ov.Union:
    m = mask & sp.lasting()   # one copy of the spans that last, worked on in place
    return ov.union(sp.start[m], sp.end[m], own=True)


def _sorted_rows(sp: Spans, mask: np.ndarray, it_of: np.ndarray, n: int
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Spans of the mask sorted by (iteration, start): indices, cuts, position in iteration."""
    idx = np.flatnonzero(mask)
    idx = idx[np.lexsort((sp.start[idx], it_of[idx]))]
    cuts = np.searchsorted(it_of[idx], np.arange(n + 1), side="left")
    pos = np.arange(idx.size) - cuts[it_of[idx]]
    return idx, cuts, pos


def _units(sp: Spans, comm: np.ndarray, host: np.ndarray, it_of: np.ndarray, n: int,
           ends: LayerEnds) -> Units:
    ci, cuts, pos = _sorted_rows(sp, comm, it_of, n)
    hi_, hcuts, _ = _sorted_rows(sp, host, it_of, n)
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
    return Units(k, pos, ready, start, end, sp.nbytes[ci], hidden, code, sets, cuts)


def analyze_rank(sp: Spans) -> RankSteps:
    its = find_iterations(sp)
    lo, hi = its.start, its.end
    n = lo.size
    pid, tid = its.loop
    on_loop = (sp.pid == pid) & (sp.tid == tid)
    io_m = sp.of("io")
    wait = _u(sp, io_m & on_loop)
    work_m = io_m & ~on_loop
    work = _u(sp, work_m)
    bwd_m = sp.of("backward")
    per_layer = bwd_m & (sp.layer >= 1)
    sized = np.flatnonzero(per_layer & ~np.isnan(sp.nbytes))
    ly_sized, first = np.unique(sp.layer[sized], return_index=True)
    layer_bytes = dict(zip(ly_sized.tolist(), sp.nbytes[sized][first].tolist(), strict=True))
    gpu = sp.on_gpu()
    host_comm = sp.of("comm") & (sp.device < 0)
    if gpu.any():
        # GPU trace: phases are GPU time, kernels attributed to the range of their launch
        gcomm = gpu & sp.of("comm")
        kern = gpu & ~gcomm
        to_dev = (sp.kind_is("src", "pageable") | sp.kind_is("src", "pinned")) & \
            sp.kind_is("dst", "device")
        h2d = _u(sp, kern & ((sp.of("memcpy") & to_dev) | sp.in_phase("h2d")))
        fwd = _u(sp, kern & sp.in_phase("forward"))
        bwd_gpu = kern & sp.in_phase("backward")
        bwd = _u(sp, bwd_gpu)
        upd = _u(sp, kern & sp.in_phase("update"))
        comm_m = gcomm if gcomm.any() else host_comm
        compute = _u(sp, kern)
        bwd_m = bwd_gpu | bwd_m
        per_layer = np.zeros_like(per_layer)  # per-layer backward spans are host-side only
    else:
        h2d = _u(sp, sp.of("h2d"))
        fwd = _u(sp, sp.of("forward"))
        bwd = _u(sp, per_layer if per_layer.any() else bwd_m)
        upd = _u(sp, sp.of("update"))
        comm_m = sp.of("comm")
        compute = ov.merge(h2d, fwd, bwd, upd)
    comm = _u(sp, comm_m)
    sec = 1e9
    terms = {
        "t_iter": (hi - lo) / sec,
        "t_io": ov.measure(wait, lo, hi) / sec,
        "t_h2d": ov.measure(h2d, lo, hi) / sec,
        "t_f": ov.measure(fwd, lo, hi) / sec,
        "t_b": ov.measure(bwd, lo, hi) / sec,
        "t_u": ov.measure(upd, lo, hi) / sec,
        "t_comm": ov.measure(comm, lo, hi) / sec,
    }
    covered = ov.measure(ov.merge(wait, compute, comm), lo, hi) / sec
    terms["t_other"] = np.maximum(terms["t_iter"] - covered, 0.0)
    comm_h = ov.hidden_under(comm, compute, lo, hi)
    io_total = ov.measure(ov.merge(wait, work), lo, hi) / sec
    io_exposed = terms["t_io"]
    io_h = ov.Hidden(io_total, np.maximum(io_total - io_exposed, 0.0), io_exposed)

    # which iteration each span falls in (by its start)
    it_of = np.searchsorted(lo, sp.start, side="right") - 1
    inside = (it_of >= 0) & (sp.start < hi[np.clip(it_of, 0, n - 1)])

    layer_bs: list[dict[int, float]] = [dict() for _ in range(n)]
    for i in np.flatnonzero(per_layer & inside):
        k, ly = int(it_of[i]), int(sp.layer[i])
        layer_bs[k][ly] = layer_bs[k].get(ly, 0.0) + (sp.end[i] - sp.start[i]) / sec
    # backward's own work: per-layer spans where known (the outer autograd call also waits
    # for DDP's last all-reduce, so its end is not the end of the gradient computation)
    bi = np.flatnonzero((per_layer if per_layer.any() else bwd_m) & inside)
    big = np.iinfo(np.int64).max
    bstart = np.full(n, big, dtype=np.int64)
    bend = np.full(n, -1, dtype=np.int64)
    np.minimum.at(bstart, it_of[bi], sp.start[bi])
    np.maximum.at(bend, it_of[bi], sp.end[bi])
    bstart[bstart == big] = -1

    ends = _layer_ends(sp, per_layer & inside, it_of, n)
    units = _units(sp, comm_m & inside, host_comm & ~comm_m & inside, it_of, n, ends)

    fetch = np.flatnonzero(work_m)
    workers = len(set(sp.pid[fetch].tolist())) if fetch.size else 0
    fetch_s = float(np.mean(sp.end[fetch] - sp.start[fetch]) / sec) if fetch.size else math.nan
    # optimizer steps per iteration: pieces of the update union (nested ranges count once)
    hu = _u(sp, sp.of("update") & (sp.device < 0))
    upd_n = np.searchsorted(hu[0], hi, "left") - np.searchsorted(hu[1], lo, "right")
    return RankSteps(sp.rank, its, terms, comm_h, io_h, units, layer_bs, ends, layer_bytes,
                     bstart, bend, np.array([fetch_s]), workers, upd_n)
