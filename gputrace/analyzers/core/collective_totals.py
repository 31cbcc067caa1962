"""Per-kind totals of a rank's collectives over its analyzed iterations (count, bytes, time,
the part the job stood still for, gradient or not, the parallelism served), and the
headline's words when a multi-rank trace holds no collective, or none of the gradient."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from gputrace.analyzers.core import overlap as ov
from gputrace.analyzers.core.collectives import KINDS, Rows, gradient_mask, small_mask, told_other
from gputrace.analyzers.core.frame import Spans


@dataclass(frozen=True)
class KindTotal:
    kind: str
    count: float          # per analyzed iteration
    nbytes: float         # this rank's input bytes per iteration
    bytes_out: float
    time_s: float         # wall time in flight per iteration (each instant once)
    exposed_s: float      # the instants the job stood still for, per iteration
    gradient: bool        # counted as gradient units by the data-parallel model
    small: bool = False   # of a few bytes each (under Collectives.small_below): not units
    dim: str = ""         # the parallelism they serve (parallel.classify)
    why: str = ""         # `other`: why they serve none (parallel.classify.role)


@dataclass(frozen=True)
class Collectives:
    """What one rank's comm spans say, by kind (per analyzed iteration)."""

    kinds: list[KindTotal] = field(default_factory=list)
    recorded: int = 0               # comm spans of any kind in the whole trace
    in_iterations: int = 0          # of them, inside analyzed iterations
    sharded: str | None = None      # "fsdp2" / "fsdp1" when FSDP issued them
    group_sizes: tuple[int, ...] = ()
    small_below: float = 0.0        # a gradient collective under this many bytes is no unit
    # the instants the job stood still for the collectives the data-parallel model reads
    # as its comm (collectives.gradient_mask: the hidden-vs-exposed comm's), each instant
    # once: two kinds in flight together count once here, in each kind's own
    exposed_s: float = 0.0

    def total(self, key: str) -> float:
        return float(sum(getattr(k, key) for k in self.kinds))


def exposed_union(sp: Spans, r: Rows, compute: ov.Union, m: np.ndarray,
                  device_compute: ov.Union | None = None) -> ov.Union:
    """The instants the job stood still for the comm rows `m`, each instant once (two
    collectives in flight together expose the same instant once): a row's `wait` interval
    when recorded, to the wait's end, which may come after the collective's (and its
    issuing `call`, where recorded); a synchronous call on the loop's thread in full; else
    the part no compute covers (a GPU's comm record: no GPU compute record,
    `device_compute`, where given). The hidden-vs-exposed comm of a host trace
    (steps.analyze_rank) is this union of its comm rows too."""
    s, e = sp.start[r.idx], sp.end[r.idx]
    has_wait = r.wait_s >= 0
    w = m & has_wait
    parts = [ov.union(r.wait_s[w], r.wait_e[w])]
    # DDP's buckets given their wait at the backward's end (backward_wait): also the part
    # of their flight no compute covers, as before they had one
    implied = w & ~r.contract
    parts.append(ov.subtract(ov.union(s[implied], e[implied]), compute))
    if r.call_s.size == r.n:   # an asynchronous functional collective's issuing call
        called = w & (r.call_s >= 0)
        parts.append(ov.union(r.call_s[called], r.call_e[called]))
    sync = r.contract & ~r.is_async & ~has_wait
    parts.append(ov.union(s[m & sync], e[m & sync]))
    rest = m & ~has_wait & ~sync
    if device_compute is not None:
        on_dev = sp.device[r.idx] >= 0
        parts.append(ov.subtract(ov.union(s[rest & on_dev], e[rest & on_dev]),
                                 device_compute))
        rest &= ~on_dev
    parts.append(ov.subtract(ov.union(s[rest], e[rest]), compute))
    return ov.merge(*parts)


def exposed_ns(sp: Spans, r: Rows, compute: ov.Union, m: np.ndarray,
               device_compute: ov.Union | None = None, window: ov.Union | None = None) -> int:
    """exposed_union's length, inside `window` where given (the analyzed iterations, as the
    hidden-vs-exposed comm of a host trace measures them)."""
    u = exposed_union(sp, r, compute, m, device_compute)
    return ov.total(u if window is None else ov.intersect(u, window))


def _in_flight(sp: Spans, r: Rows, m: np.ndarray) -> float:
    """The wall time the collectives `m` were in flight, each instant once (sends and
    receives posted ahead overlap: their lifetimes are not summed)."""
    i = r.idx[m]
    return ov.total(ov.union(sp.start[i], sp.end[i])) / 1e9


def summarize(sp: Spans, r: Rows, it_of: np.ndarray, sel: np.ndarray, compute: ov.Union,
              device_compute: ov.Union | None = None,
              window: ov.Union | None = None) -> Collectives:
    """Per-kind totals over the analyzed iterations `sel` (it_of: each comm row's iteration,
    -1 outside any; compute, device_compute, window: as exposed_ns)."""
    if not r.n:
        return Collectives()
    grad = gradient_mask(sp, r) & ~told_other(r)   # told `other`: comm, never gradient
    small = small_mask(r)
    inside = np.isin(it_of, sel)
    n_it = max(int(sel.size), 1)
    kinds = np.array(r.kind)
    out = []
    dims = np.array(r.dim if len(r.dim) == r.n else [""] * r.n)
    why = np.array(r.why if len(r.why) == r.n else [""] * r.n, dtype=object)
    memo: dict[bytes, float] = {}

    def exposed(m: np.ndarray) -> float:
        """exposed_ns per iteration, each set of rows once (a run's only kind: the model's)"""
        key = np.packbits(m).tobytes()
        if key not in memo:
            memo[key] = exposed_ns(sp, r, compute, m, device_compute, window) / 1e9 / n_it
        return memo[key]

    for k in [k for k in KINDS if k in set(r.kind)]:
        for d in sorted(set(dims[kinds == k].tolist())):   # a row per parallelism served
            for w in sorted(set(why[(kinds == k) & (dims == d)].tolist())):  # and reason
                for few in (False, True):   # a kind's collectives of a few bytes apart
                    m = inside & (kinds == k) & (small == few) & (dims == d) & (why == w)
                    if not m.any():
                        continue
                    out.append(KindTotal(k, float(m.sum()) / n_it,
                                         float(np.nansum(r.nbytes[m])) / n_it,
                                         float(np.nansum(r.bytes_out[m])) / n_it,
                                         _in_flight(sp, r, m) / n_it,
                                         exposed(m),
                                         bool(grad[m].any()) and not few, few, d, w))
    sharded = next((f for f in r.fsdp if f), None)
    sizes = tuple(sorted({int(g) for g in r.group_size if g > 0}))
    # the comm the data-parallel model reads; inside `window`, every such row's instants
    # there (as the hidden-vs-exposed comm takes them), wherever the row began
    model = gradient_mask(sp, r) if window is not None else inside & gradient_mask(sp, r)
    return Collectives(out, r.n, int(inside.sum()), sharded, sizes, r.small_below,
                       exposed(model))


def missing_message(world: int, tf_unprofiled: bool = False, outside: int = 0) -> str:
    """The headline's words for a multi-rank trace without one collective in its analyzed
    iterations (`outside`: how many were recorded outside them: before, after, in warm-up)."""
    where = "" if not outside else f" in the analyzed iterations (only {outside} outside them)"
    head = (f"{world} ranks, but no collective was recorded{where}: the ranks' communication "
            "(all-reduce, all-gather, reduce-scatter...) is not in this trace, so no comm "
            "figure, Case or speedup can be given; ")
    if tf_unprofiled:
        return head + ("TensorFlow's collectives are seen through its profiler, which was "
                       "off in this run (a multi-worker job's default): record again with "
                       "--tf-steps START:COUNT to profile those steps")
    return head + ("record with a gputrace whose torch collector captures torch.distributed "
                   "collectives, or import a trace that has the NCCL kernels")


def gradient_missing_message(world: int, kinds: list[KindTotal]) -> str:
    """The headline's words for a multi-rank trace whose analyzed iterations hold
    collectives, none of them a gradient unit."""
    what = ", ".join(f"{k.kind} x{k.count:.3g}" + (" of a few bytes" if k.small else "")
                     for k in kinds)
    return (f"{world} ranks, but no gradient communication was recorded in the analyzed "
            f"iterations (only {what} per iteration): the ranks' gradient exchange is not "
            "in this trace, or not as collectives the data-parallel model reads (DDP's "
            "buckets, a job's own all-reduces of gradients, FSDP's collectives), so no Case, "
            "speedup or what-if can be given from it")
