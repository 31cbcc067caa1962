"""Shi & Chu's performance model from a trace: strategy and Case detection, and the
predicted iteration time from measured terms (the equations themselves: analyzers.core.equations)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from gputrace.analyzers.core.equations import (  # noqa: F401 - the paper's equations, here too
    eq1,
    eq2,
    eq4,
    eq5,
    eq6,
    eq7,
    eq8,
    eq9,
    eq10,
    eq11,
    eq12,
    r_u2g,
    ring_factor,
    t_io_from_bandwidth,
)
from gputrace.analyzers.core.steps import RankSteps
from gputrace.analyzers.findings.sanity import eq12_over, far_off

# -- from a trace ---------------------------------------------------------------------------


@dataclass(frozen=True)
class UnitStats:
    index: int
    layers: tuple[int, ...] | None
    nbytes: float
    ready_s: float
    start_s: float
    end_s: float
    duration_s: float
    hidden: bool
    hidden_fraction: float
    kind: str = "all_reduce"   # the collective's kind (analyzers.core.collectives.KINDS)


@dataclass(frozen=True)
class ModelResult:
    strategy: str
    case: int | None
    C: int | None
    C_unit: int | None
    equation: str
    predicted_t_iter: float
    measured_t_iter: float
    relative_error: float
    io_pipelined: bool
    t_io_pipelined: float | None
    terms: dict[str, float]
    units: list[UnitStats] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    eq7_t_iter: float | None = None     # the paper's Case 2 equation, for comparison
    t_b_first: float | None = None      # eq. 5: backward before the first unit starts
    comm_span: float | None = None      # eq. 5: first unit start to last unit end


def mean_terms(rs: RankSteps, sel: np.ndarray) -> dict[str, float]:
    return {k: float(np.mean(v[sel])) if sel.size else 0.0 for k, v in rs.terms.items()}


def unit_stats(rs: RankSteps, sel: np.ndarray) -> list[UnitStats]:
    """Per unit index, means over the analyzed iterations (times from iteration start)."""
    u = rs.units
    rows = u.rows(sel)
    if not rows.size:
        return []
    idx = u.index[rows]
    t0 = rs.iterations.start[u.it[rows]]
    m = int(idx.max()) + 1
    cnt = np.bincount(idx, minlength=m)

    def mean(v: np.ndarray) -> np.ndarray:
        return np.bincount(idx, weights=v, minlength=m) / np.maximum(cnt, 1)

    nb = mean(u.nbytes[rows])
    ready, start, end = (mean((x[rows] - t0) / 1e9) for x in (u.ready, u.start, u.end))
    dur = mean((u.end[rows] - u.start[rows]) / 1e9)
    hid = np.bincount(idx, weights=u.hidden[rows], minlength=m)
    last = np.full(m, -1, dtype=np.int64)
    np.maximum.at(last, idx, rows)      # the latest iteration's row gives the layers
    return [UnitStats(index=i, layers=u.layers(int(last[i])), nbytes=float(nb[i]),
                      ready_s=float(ready[i]), start_s=float(start[i]), end_s=float(end[i]),
                      duration_s=float(dur[i]), hidden=bool(hid[i] * 2 > cnt[i]),
                      hidden_fraction=float(hid[i] / cnt[i]))
            for i in range(m) if cnt[i]]


def unit_waits(rs: RankSteps, sel: np.ndarray, arrival: np.ndarray | None
               ) -> dict[int, float]:
    """Per unit index, the mean time (s) the rank waited inside the unit for the last rank
    to arrive (`arrival`: ns per unit row, as `_comm_wait` gives it; none: no wait known)."""
    u = rs.units
    rows = u.rows(sel)
    if arrival is None or not rows.size:
        return {}
    w = np.clip(arrival[rows] - u.start[rows], 0, np.maximum(u.end[rows] - u.start[rows], 0))
    idx = u.index[rows]
    cnt = np.bincount(idx)
    mean = np.bincount(idx, weights=w / 1e9) / np.maximum(cnt, 1)
    return {i: float(mean[i]) for i in np.flatnonzero(cnt).tolist()}


def _overlapped(rs: RankSteps, sel: np.ndarray) -> bool:
    """Most iterations start their first unit before backward ends."""
    u = rs.units
    ks = sel[(np.diff(u.cuts)[sel] > 0) & (rs.backward_end[sel] >= 0)]
    first = u.start[u.cuts[ks]]
    return int(np.sum(np.where(first < rs.backward_end[ks], 1, -1))) > 0


def build_model(rs: RankSteps, sel: np.ndarray) -> ModelResult:
    t = mean_terms(rs, sel)
    units = unit_stats(rs, sel)
    notes: list[str] = []
    measured = t["t_iter"]
    pipelined = rs.loader_workers > 0 and not math.isnan(float(rs.fetch_s[0]))
    t_io_pipe = float(rs.fetch_s[0]) / rs.loader_workers if pipelined else None
    t_gpu = t["t_h2d"] + t["t_f"] + t["t_b"] + t["t_u"]
    other = t["t_other"] + t.get("t_framework", 0.0)   # the framework's own work likewise
    if other > 0.05 * measured:
        notes.append(f"{other:.4f} s per iteration is in no phase (the work between the "
                     "phases); it is added to every equation as t_other")
    # the other dimensions' exposed comm and the pipeline's bubble: on the critical path
    par = {k: t[k] for k in ("t_tp", "t_pp", "t_ep", "t_cp") if t.get(k, 0.0) > 0}
    if par:
        notes.append(" + ".join(f"{k} {v * 1e3:.1f} ms" for k, v in par.items())
                     + " per iteration (tensor/pipeline/expert/context parallelism) is on "
                     "the critical path; it is added to every equation")
        other += sum(par.values())

    def with_io(compute_path: float) -> float:
        if pipelined and t_io_pipe is not None:
            return max(compute_path + t["t_io"], t_io_pipe)  # eq. 4's max
        return compute_path + t["t_io"]

    case = c_layer = c_unit = None
    eq7_value = t_b_first = comm_span = None
    if not units and t["t_comm"] <= 0:
        strategy = "sequential"
        equation = "4" if pipelined else "1"
        predicted = with_io(t_gpu + other)
    elif not units or not _overlapped(rs, sel):   # no unit: comm of a few bytes only
        strategy = "sequential"
        equation = "4" if pipelined else "2"
        predicted = with_io(t_gpu + t["t_comm"] + other)
    else:
        upd_per_iter = float(np.mean(rs.update_spans[sel])) if sel.size else 0.0
        strategy = "wfbp" if upd_per_iter > 1.5 else "wfbp_update_after"
        exposed = [u for u in units[:-1] if not u.hidden]
        case = 1 if not exposed else 2
        last = units[-1]
        t_u_1 = t["t_u"] / max(upd_per_iter, 1.0) if strategy == "wfbp" else t["t_u"]
        if case == 1:
            equation = "6" if strategy == "wfbp" else "10"
            path = t["t_h2d"] + t["t_f"] + t["t_b"] + last.duration_s + t_u_1 + other
        else:
            c_unit = max(u.index for u in exposed)
            layer_sets = [u.layers for u in exposed if u.layers]
            c_layer = min(min(ls) for ls in layer_sets) if layer_sets else None
            exposed_comm = [u.duration_s for u in units[:-1] if u.index <= c_unit]
            if c_layer is not None:
                t_b_before = [float(np.mean([rs.layer_backward_s[k].get(ly, 0.0) for k in sel]))
                              for ly in range(1, c_layer)]
            else:  # no layers known: the backward after the exposed units were ready
                t_b_before = [max(t["t_b"] - units[c_unit].ready_s + units[0].ready_s, 0.0)]
                notes.append("comm units carry no layers: C is given in unit indices only")
            eq7_value = with_io(t["t_h2d"] + t["t_f"] + sum(exposed_comm) + sum(t_b_before)
                                + last.duration_s + t_u_1 + other)
            # Eq. 7 adds the exposed units' durations end to end; where units run
            # concurrently (gloo, several NCCL channels) that overcounts, so the prediction
            # uses eq. 5, from which eq. 6 and 7 derive, with the measured comm span.
            ks = sel[rs.backward_start[sel] >= 0]
            bstart = (rs.backward_start[ks] - rs.iterations.start[ks]) / 1e9
            b0 = float(np.mean(bstart)) if bstart.size else units[0].ready_s
            t_b_first = max(units[0].start_s - b0, 0.0)
            comm_span = max(u.end_s for u in units) - units[0].start_s
            equation = "5"
            path = (t["t_h2d"] + t["t_f"] + t_b_first + comm_span
                    + (t_u_1 if strategy == "wfbp" else t["t_u"]) + other)
        predicted = with_io(path)
    err = (predicted - measured) / measured if measured > 0 else 0.0
    return ModelResult(strategy, case, c_layer, c_unit, equation, predicted, measured, err,
                       pipelined, t_io_pipe, t, units, notes, eq7_value, t_b_first, comm_span)


# -- speedup ------------------------------------------------------------------------------


@dataclass(frozen=True)
class SpeedupPoint:
    gpus: int
    speedup: float
    efficiency: float
    t_iter: float
    t_comm: float
    withheld: str | None = None     # why its figures (then nan) are not given


def checked(p: SpeedupPoint, measured: float) -> SpeedupPoint:
    """The point, or its figures withheld when it predicts an iteration far from the
    measured one."""
    why = far_off(p.t_iter, measured)
    return p if why is None else SpeedupPoint(p.gpus, math.nan, math.nan, math.nan,
                                              math.nan, why)


@dataclass(frozen=True)
class Speedup:
    equation: str
    world_size: int
    points: list[SpeedupPoint]
    assumptions: list[str]
    allreduce_efficiency: float | None
    link_bytes_per_s: float | None
    grad_bytes: float
    unavailable: str | None = None      # why no speedup is predicted (a term not measured)
    shared: str | None = None           # what the measured ranks shared (cores, a GPU)
    allreduce_efficiency_withheld: str | None = None   # eq. 12 over 100 %: what is wrong


def speedup(m: ModelResult, world_size: int, gpus: Sequence[int],
            link_bytes_per_s: float | None = None, shared_io: bool = False,
            layer_grad_bytes: float = 0.0, contention_s: float = 0.0,
            shared: str | None = None, unit_waits: dict[int, float] | None = None
            ) -> Speedup:
    """Eq. 8 / 9 / 11 for N GPUs from the measured terms (weak scaling). Without measured
    comm, `layer_grad_bytes` (the backward spans' bytes) is what an all-reduce would move.
    `contention_s`: backward time per iteration that comm on the CPU took from it (the
    replay's estimate); one GPU, with no comm, does not pay it. `shared`: what the measured
    ranks shared (a host's cores, one GPU): their compute, measured while sharing, is slower
    than one rank alone; the prediction keeps it as measured and says so. `unit_waits`: per
    unit index, the time this rank waited inside the unit for the last rank to arrive
    (`unit_waits`); a wait is not a transfer and is not scaled with 2(N-1)/N."""
    t = dict(m.terms)
    t["t_other"] = t["t_other"] + t.get("t_framework", 0.0)   # neither scales with N
    t_gpu = t["t_h2d"] + t["t_f"] + t["t_b"] + t["t_u"] + t["t_other"]
    t_io_1 = t["t_io"]
    grad_bytes = float(sum(u.nbytes for u in m.units if not math.isnan(u.nbytes))) or \
        layer_grad_bytes
    assumptions = ["weak scaling: the same batch per GPU, so t_io, t_h2d, t_f, t_b, t_u stay",
                   "t_io per rank does not grow with N (each rank loads its own data)"
                   if not shared_io else "one loader feeds all GPUs of a node: t_io grows with N"]
    n = max(world_size, 1)
    comm_units = [u.duration_s for u in m.units]
    measured_comm = t["t_comm"]
    if n > 1:
        waits = unit_waits or {}
        if m.strategy == "sequential" or not comm_units:   # units one after another
            wait = min(sum(waits.get(u.index, 0.0) for u in m.units), measured_comm)
            whose = "its units", "them"
        else:                                               # the last unit's own wait
            wait = min(waits.get(m.units[-1].index, 0.0), comm_units[-1])
            # (other units may move meanwhile: not the rank's wall time waiting for peers)
            whose = "the last unit", "it"
        assumptions.append(f"ring all-reduce: comm time scales with 2(N-1)/N from the measured "
                           f"{n} ranks" + (f", except the {wait * 1e3:.1f} ms per iteration "
                                           f"{whose[0]} spent waiting for the last rank to reach "
                                           f"{whose[1]}, which stays" if wait > 0 else ""))

        def comm_at(N: int, d: float) -> float:
            keep = min(wait, d)
            return keep + (d - keep) * ring_factor(N) / ring_factor(n)
    elif link_bytes_per_s and grad_bytes > 0:
        assumptions.append(f"ring all-reduce of {grad_bytes / 1e6:.1f} MB of gradients at "
                           f"{link_bytes_per_s / 1e9:.2f} GB/s, no latency"
                           + ("" if comm_units else ", after backward (no overlap)"))

        def comm_at(N: int, d: float) -> float:
            share = d / measured_comm if measured_comm else 1.0
            return share * ring_factor(N) * grad_bytes / link_bytes_per_s
    else:
        # never "comm is free": a prediction for N GPUs needs what the comm would move and
        # how fast
        need = [w for w, ok in (("the gradient bytes (backward spans with bytes, as the torch "
                                 "collector records them)", grad_bytes > 0),
                                ("a link bandwidth (run `gputrace probe` on this host before "
                                 "recording, or pass --link-bandwidth)",
                                 bool(link_bytes_per_s))) if not ok]
        assumptions.append("no comm measured")
        return Speedup("8", n, [], assumptions, None, link_bytes_per_s, grad_bytes,
                       "one process and no comm measured: a prediction for N GPUs needs "
                       + " and ".join(need), shared)

    overlapped = not (m.strategy == "sequential" or not comm_units)
    equation = "8" if not overlapped else ("9" if m.strategy == "wfbp" else "11")
    pts = []
    unavailable = None
    missing = [k for k in ("t_f", "t_b") if t[k] <= 0]
    if missing:
        # a speedup from an iteration whose compute was not seen would be meaningless
        unavailable = (f"{' and '.join(missing)} not measured: the trace has no forward/"
                       "backward phases (or no GPU record was attributed to one), so eq. "
                       f"{equation} has no compute to scale")
        gpus = []
    if shared:
        assumptions.append(f"the measured ranks shared {shared}: each rank's compute is as "
                           "measured while sharing (slower than one rank alone would be); "
                           "N GPUs each as fast as one of these ranks")
    one = t_io_1 + t_gpu
    if contention_s > 0 and one > contention_s:
        assumptions.append(f"one GPU's iteration is {contention_s * 1e3:.1f} ms shorter than "
                           "the measured compute: comm on the CPU slowed backward that much")
    def path(N: int) -> tuple[float, float]:
        """(the denominator of eq. 8 / 9 / 11 at N GPUs: the iteration, the comm in it)."""
        io_n = t_io_1 * (N if shared_io else 1)
        if m.strategy == "sequential" or not comm_units:
            tc = comm_at(N, measured_comm) if N > 1 else 0.0
            return io_n + t_gpu + tc, tc
        last = comm_at(N, comm_units[-1]) if N > 1 else 0.0
        if m.case == 2 and m.comm_span is not None and m.t_b_first is not None:
            # eq. 5 with the comm span scaled, never below the compute-only path
            span = comm_at(N, m.comm_span) if N > 1 else 0.0
            rest = max(t["t_h2d"] + t["t_f"] + m.t_b_first + span + t["t_u"] + t["t_other"],
                       t_gpu + last)
        else:   # eq. 6 / 10; eq. 11 has the same form with full t_u
            rest = t["t_h2d"] + t["t_f"] + t["t_b"] + last + t["t_u"] + t["t_other"]
        return io_n + rest, last

    # one figure, one value: at the measured GPU count the iteration is the model's own
    # prediction (build_model's eq.); the other counts move from it by what the comm changes
    anchor = m.predicted_t_iter - path(n)[0] if gpus and m.predicted_t_iter > 0 else 0.0
    for N in gpus:
        t_iter, tc = path(N)
        t_iter += anchor
        s = eq9(N, t_io_1, t_gpu, t_iter, 0.0) if t_iter > 0 else math.nan
        if contention_s > 0 and one > contention_s:
            s *= (one - contention_s) / one
        pts.append(checked(SpeedupPoint(N, s, s / N, t_iter, tc), m.measured_t_iter))
    eff = over = None
    if link_bytes_per_s and measured_comm > 0 and grad_bytes > 0:
        eff = eq12(grad_bytes * n, measured_comm, link_bytes_per_s)
        if eff > 1.0:   # never an efficiency over 100 %: say what does not add up
            eff, over = None, eq12_over(eff, grad_bytes, n, measured_comm, link_bytes_per_s)
    return Speedup(equation, n, pts, assumptions, eff, link_bytes_per_s, grad_bytes,
                   unavailable, shared, over)
