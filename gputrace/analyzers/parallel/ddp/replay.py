"""What-if by replaying the measured gradient timeline: link bandwidth, GPU count and bucket
size (the paper's "merged-layer" future work, Sec. VI).

The replay keeps everything the run measured except gradient communication:

- when each layer's gradient is ready (the end of its backward, mean over the analyzed
  iterations, from the iteration start) and how many bytes it has;
- a comm cost per unit: a fixed `alpha` (latency) plus a time per byte, scaled with the
  ring all-reduce factor 2(N-1)/N to other GPU counts. The time per byte is the slower of the
  host's (CPU seconds per byte: gloo copies and reduces on the CPU) and the link's (its bus
  bandwidth, when known from `gputrace probe` or --link-bandwidth); a faster link only helps
  a unit the link held back. Fitted to the measured units' service times (a unit's time once
  the one before it has finished). With no comm measured (one process), the link bandwidth;
- comm takes the CPU from the compute it overlaps when it runs on the CPU (gloo): while a
  unit moves bytes during backward, backward loses the CPU time those bytes cost, and the
  unit gets at most half the CPU; the measured ready times are first freed of what the
  measured comm took from them. NCCL on a GPU runs on its own SMs: no such cost is modeled;
- units run one at a time in ready order (one NCCL stream, one gloo queue); a unit starts
  when it is ready and the one before it has finished; a unit whose layers are not known
  (TensorFlow's collectives) is ready when it started, freed of what the comm before it
  took from backward; a measured unit keeps the delay it was launched with after it could
  start, and on the CPU the time its link sat idle waiting for the last rank (units of
  other bucket sizes have neither, and are held against a replay without them);
- the update waits for the last unit (PyTorch DDP, eq. 10/11; comm after backward, eq. 8,
  is the case where every unit is ready at the end of backward).

The predicted iteration is the measured one plus the change of the exposed tail
max(backward end, last comm end) against the replay of the measured configuration, so the
model's own error cancels; that error is reported beside it (`baseline_error`). A replay of
the measured configuration over 5 % off the measured iteration predicts nothing, and a
scenario the run cannot tell (bucket sizes without per-layer gradients, a faster link where
no link bandwidth is known and the host's rate stands for it) is a row with the reason
(replay_why). Every prediction carries a 95 % interval from resampling the analyzed
iterations (their spread and the cost fit's), and says when it leaves the range the run
measured.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from gputrace.analyzers.core.model import ModelResult, unit_stats
from gputrace.analyzers.core.steps import RankSteps
from gputrace.analyzers.findings.sanity import far_off
from gputrace.analyzers.parallel import whatif_bands
from gputrace.analyzers.parallel.ddp.replay_inputs import (
    busy_beside_backward,
    idle_waits,
    layer_profile,
    unit_timing,
    units_in_iterations,
)
from gputrace.analyzers.parallel.ddp.replay_sim import (
    CPU_SHARE,
    CommCost,
    UnitRun,
    buckets_by_cap,
    fit_cost,
    fit_host_cost,
    run_units,
)
from gputrace.analyzers.parallel.ddp.replay_why import baseline_off, scenario_unknown, too_small
from gputrace.analyzers.parallel.ddp.replay_why import why_no_replay as why_no_replay

MIB = 1 << 20
DEFAULT_BUCKETS = (1 * MIB, 5 * MIB, 25 * MIB, 100 * MIB, math.inf)   # inf: one bucket
DDP_FIRST_BUCKET = 1 * MIB       # DDP's first bucket when bucket_cap_mb is left at its default
RESAMPLES = 64                   # iteration resamples behind each interval


@dataclass(frozen=True)
class Scenario:
    gpus: int                           # 0: the run's own world size (2 for one process)
    bandwidth_x: float = 1.0
    bucket_bytes: float | None = None   # None: the buckets as measured; inf: one bucket

    @property
    def label(self) -> str:
        b = ("measured buckets" if self.bucket_bytes is None else "one bucket"
             if math.isinf(self.bucket_bytes) else f"bucket_cap_mb={self.bucket_bytes / MIB:g}")
        bw = "" if self.bandwidth_x == 1 else f", link x{self.bandwidth_x:g}"
        return f"{self.gpus} GPUs, {b}{bw}"


@dataclass(frozen=True)
class Outcome:
    scenario: Scenario
    buckets: int
    comm_s: float           # time on the link per iteration (sum of unit times)
    exposed_s: float        # comm past the end of backward
    t_iter: float
    speedup: float          # over one GPU (the same iteration with no comm), weak scaling
    low: float = math.nan   # 95 % interval of t_iter (iterations resampled)
    high: float = math.nan
    reference_t_iter: float = math.nan   # the same GPU count, buckets as measured, link x1
    extrapolated: str | None = None      # why the prediction leaves what the run measured
    withheld: str | None = None          # why its figures (then nan) are not given


@dataclass(frozen=True)
class Replay:
    cost: CommCost
    backward_end_s: float
    measured_t_iter: float
    baseline_t_iter: float          # the replay of the measured configuration, absolute
    baseline_error: float
    layers_known: bool              # per-layer bytes and ready times: bucket what-ifs work
    measured_units: int             # 0: no comm measured; "measured buckets" are DDP's default
    outcomes: list[Outcome]
    assumptions: list[str] = field(default_factory=list)
    contention_s: float = 0.0       # backward time per iteration the measured comm took
    world: int = 1                  # the ranks that ran (a scenario of others: a GPU count)

    def kind(self, o: Outcome) -> str | None:
        """An outcome's what-if kind (analyzers.parallel.whatif_bands; None: the run's own)."""
        s = o.scenario
        return whatif_bands.kind_of_scenario(s.gpus, self.world, s.bandwidth_x, s.bucket_bytes)


# -- the plan of one set of iterations, and its predictions ----------------------------------


@dataclass(frozen=True)
class _Plan:
    cost: CommCost
    measured_t_iter: float
    b_start: float              # backward, freed of the measured comm's CPU (s from start)
    b_end: float
    b_end_measured: float
    measured_tail: float
    ready: dict[int, float]     # layer -> ready on the freed clock
    nbytes: dict[int, float]
    units: list[tuple[float, ...]]   # measured units (bytes, ready on the freed clock[, delay])
    contention_s: float
    sequential: bool
    plain_units: list[tuple[float, ...]]   # the same without their delays and waits


def _stolen_rate(cost: CommCost) -> float:
    """The share of backward's CPU a unit takes while it moves bytes beside it (measured
    configuration)."""
    p_ov, cpu = cost.per_byte(cost.world if cost.world > 1 else 2, 1.0, overlapped=True)
    return cpu / p_ov if p_ov > 0 else 0.0


def _plan(rs: RankSteps, sel: np.ndarray, m: ModelResult, world: int,
          link_bytes_per_s: float | None, on_cpu: bool, arrivals: np.ndarray | None = None,
          host_bytes_per_s: float | None = None) -> _Plan | None:
    rows, it, begin, end, nb = units_in_iterations(rs, sel)
    measured = float(np.mean(rs.terms["t_iter"][sel]))
    cost: CommCost | None = None
    busy: dict[int, list[tuple[float, float]]] = {}
    if world > 1 and rows.size:
        if on_cpu:
            # a unit moves bytes once the last rank has it: the wait for peers is no cost
            arrive = (arrivals if arrivals is not None else rs.units.start)[rows] - \
                rs.iterations.start[it]
            beside, alone, busy = busy_beside_backward(rs, it, np.minimum(arrive, end), end)
            cost = fit_host_cost(float(np.nansum(nb)), beside, alone, world, link_bytes_per_s,
                                 host_bytes_per_s)
        else:
            ok = ~np.isnan(nb) & (end > begin)
            cost = fit_cost(nb[ok], (end - begin)[ok] / 1e9, world)
    if cost is None and link_bytes_per_s:
        cost = CommCost(0.0, link_bytes_per_s, 1, "link", wire_bytes_per_s=link_bytes_per_s)
    if cost is None:
        return None
    t0 = rs.iterations.start
    ks = sel[rs.backward_end[sel] >= 0]
    b_end_m = float(np.mean((rs.backward_end[ks] - t0[ks]) / 1e9)) if ks.size else measured
    b_start_m = float(np.mean((rs.backward_start[ks] - t0[ks]) / 1e9)) if ks.size else b_end_m
    ready, nbytes = layer_profile(rs, sel)
    # what the measured comm took from backward: its time on the link beside backward, at
    # the rate a unit takes the CPU, up to each moment of each iteration
    rate = _stolen_rate(cost) if cost.cpu_s_per_byte > 0 else 0.0
    taken_by: dict[int, float] = {}
    contention = 0.0
    b0s = dict(zip(ks.tolist(), ((rs.backward_start[ks] - t0[ks]) / 1e9).tolist(), strict=True))

    def taken(k: int, upto: float) -> float:
        lo = b0s.get(k, 0.0)
        return rate * sum(max(min(e_, upto) - max(s_, lo), 0.0) for s_, e_ in busy.get(k, []))

    if rate > 0 and busy:
        le = rs.layer_ends
        lrows = le.rows(sel)
        for ly in set(le.layer[lrows].tolist()):
            mine = lrows[le.layer[lrows] == ly]
            taken_by[ly] = float(np.mean([taken(int(le.it[r]), (le.end[r] - t0[le.it[r]]) / 1e9)
                                          for r in mine]))
        contention = float(np.mean([taken(int(k), (rs.backward_end[k] - t0[k]) / 1e9)
                                    for k in ks])) if ks.size else 0.0
    ready = {ly: r - taken_by.get(ly, 0.0) for ly, r in ready.items()}
    b_end = b_end_m - contention
    sequential = m.strategy == "sequential" and len(m.units) > 1
    units_ = unit_stats(rs, sel) if sel.size else []
    timing = unit_timing(rs, sel, taken if rate > 0 and busy else None, sequential)
    # comm on the CPU: its cost was fitted from when the last rank arrived, so the wait for
    # it, with the link idle, is the unit's own (it stays, as in the speedup model)
    waits = idle_waits(rs, sel, arrivals) if on_cpu and arrivals is not None else {}
    measured_units: list[tuple[float, ...]] = []
    plain: list[tuple[float, ...]] = []
    for u in units_:
        if math.isnan(u.nbytes):
            continue
        # no layers: ready when it started (on the freed clock); each unit then keeps the
        # delay it was launched with once it could start
        freed, delay = timing.get(u.index, (u.ready_s, 0.0))
        if sequential:
            when = b_end
        elif u.layers and all(ly in ready for ly in u.layers):
            when = max(ready[ly] for ly in u.layers)     # ready once all its layers are
        else:
            when = freed
        measured_units.append((u.nbytes, min(when, b_end), delay + waits.get(u.index, 0.0)))
        plain.append((u.nbytes, min(when, b_end)))
    if sequential:
        ready = {ly: b_end for ly in ready}
    measured_end = max((u.end_s for u in units_), default=b_end_m)
    return _Plan(cost, measured, b_start_m, b_end, b_end_m, max(b_end_m, measured_end), ready,
                 nbytes, measured_units, contention, sequential, plain)


def _buckets(p: _Plan, s: Scenario) -> list[tuple[float, ...]]:
    if s.bucket_bytes is None:
        if p.units:
            return p.units
        # one process: DDP's default, a 1 MiB first bucket then 25 MiB ones
        return buckets_by_cap(p.ready, p.nbytes, 25 * MIB, DDP_FIRST_BUCKET)
    return buckets_by_cap(p.ready, p.nbytes, s.bucket_bytes)


def _tail(p: _Plan, s: Scenario) -> tuple[int, UnitRun]:
    bs = _buckets(p, s)
    if p.cost.cpu_s_per_byte > 0:
        return len(bs), run_units(bs, p.cost, s.gpus, s.bandwidth_x, (p.b_start, p.b_end))
    r = run_units(bs, p.cost, s.gpus, s.bandwidth_x)   # comm does not slow backward
    return len(bs), UnitRun(max(r.comm_end, p.b_end) if bs else p.b_end, r.busy, p.b_end)


def _predict(p: _Plan, s: Scenario, base: tuple[float, float]) -> tuple[int, UnitRun, float]:
    """`base`: the tails of the measured configuration replayed with the measured units'
    launch delays and waits for the last rank, and without: buckets of other sizes are not
    the measured units and carry neither, so they are held against the replay without."""
    n, r = _tail(p, s)
    tail = base[0] if s.bucket_bytes is None else base[1]
    return n, r, p.measured_t_iter - tail + max(r.backward_end, r.comm_end)


def _base(p: _Plan, world: int) -> tuple[float, float]:
    out = []
    for units in (p.units, p.plain_units):
        _, r = _tail(replace(p, units=units), Scenario(world if world > 1 else 1))
        out.append(max(r.backward_end, r.comm_end))
    return out[0], out[1]


def _extrapolation(s: Scenario, world: int, p: _Plan) -> str | None:
    why = []
    if s.gpus > max(world, 1):
        why.append(f"{s.gpus} GPUs where {world} ran (comm scaled by 2(N-1)/N)")
    if s.bandwidth_x != 1:
        why.append(f"a link x{s.bandwidth_x:g} (its speed was not measured)")
    sizes = [b[0] for b in p.units]
    if s.bucket_bytes is not None and sizes:
        lo, hi = min(sizes), max(sizes)
        biggest = min(s.bucket_bytes, sum(p.nbytes.values()) or math.inf)
        if biggest > hi * 1.5 or (not math.isinf(s.bucket_bytes) and s.bucket_bytes < lo / 1.5):
            why.append(f"units of {biggest / MIB:.1f} MiB where the run's were "
                       f"{lo / MIB:.1f}-{hi / MIB:.1f} MiB (cost fitted on those)")
    return "; ".join(why) or None


def replay(rs: RankSteps, sel: np.ndarray, m: ModelResult, world: int, gpus: Sequence[int],
           link_bytes_per_s: float | None = None,
           extra: Sequence[Scenario] = (), on_cpu: bool | None = None,
           intervals: bool = True, arrivals: np.ndarray | None = None,
           host_bytes_per_s: float | None = None) -> Replay | None:
    """The default what-if grid (GPU counts x bucket sizes, and link x2 / x0.5) plus `extra`;
    None when nothing can be replayed (no comm measured and no link bandwidth known).
    `on_cpu`: the comm ran beside compute on the CPU (gloo); default: the rank's phases come
    from no GPU record. `intervals`: resample the iterations for each prediction's interval."""
    if not sel.size:
        return None
    if on_cpu is None:
        on_cpu = not rs.gpu
    p = _plan(rs, sel, m, world, link_bytes_per_s, on_cpu, arrivals, host_bytes_per_s)
    if p is None or not (p.units or sum(p.nbytes.values()) > 0):
        return None         # no bytes to move: nothing to replay
    if p.cost.source == "measured" and too_small(rs, sel):
        return None         # a cost per byte of a few bytes' comm: why_no_replay says so
    cost = p.cost
    assumptions = []
    if cost.source == "measured" and cost.cpu_s_per_byte > 0:
        link = (f"the link's {cost.wire_bytes_per_s / 1e9:.3f} GB/s bus bandwidth"
                if cost.wire_bytes_per_s else "no link bandwidth known (`gputrace probe` or "
                "--link-bandwidth): the host's rate stands for the link's")
        assumptions.append(
            f"comm per unit = {cost.alpha_s * 1e3:.3f} ms + bytes x the slower of the host's "
            f"{cost.cpu_s_per_byte * 1e9:.3f} ns/B of CPU and {link}, fitted to the measured "
            f"units at {world} ranks, scaled by 2(N-1)/N")
        assumptions.append(
            f"comm on the CPU takes backward's CPU: a unit beside backward gets at most "
            f"{CPU_SHARE:.0%} of it; the measured comm took {p.contention_s * 1e3:.1f} ms of "
            "backward per iteration, which the replay gives back before re-running it")
    elif cost.source == "measured":
        assumptions.append(f"comm per unit = {cost.alpha_s * 1e3:.3f} ms + bytes / "
                           f"{cost.beta_bytes_per_s / 1e9:.3f} GB/s, fitted to the measured "
                           f"units at {world} ranks, scaled by 2(N-1)/N; comm does not slow "
                           "the compute it overlaps (" + ("the link held it back, not the "
                                                          "host's CPU" if on_cpu else
                                                          "NCCL on its own SMs") + ")")
    else:
        assumptions.append(f"no comm measured: ring all-reduce at {link_bytes_per_s / 1e9:.3f} "
                           "GB/s bus bandwidth, no latency, no cost to the compute it overlaps")
    if p.sequential:
        assumptions.append("comm after backward: every unit is ready when backward ends")
    if not p.units:
        assumptions.append("one process: \"measured buckets\" are DDP's default (a 1 MiB first "
                           "bucket, then 25 MiB)")
    layers_known = bool(p.ready) and bool(p.nbytes) and set(p.nbytes) <= set(p.ready)
    counts = sorted({n for n in (*([world] if world > 1 else []), *gpus) if n > 1})
    scenarios: list[Scenario] = [Scenario(n) for n in counts]
    if layers_known:
        scenarios += [Scenario(n, 1.0, b) for b in DEFAULT_BUCKETS for n in counts]
    else:
        assumptions.append("no per-layer gradient bytes and ready times: bucket sizes are "
                           "not replayed")
    ref = world if world > 1 else (counts[0] if counts else 2)
    scenarios += [Scenario(ref, x) for x in (2.0, 0.5)]
    scenarios += [s for s in (Scenario(x.gpus or ref, x.bandwidth_x, x.bucket_bytes)
                              for x in extra) if s not in scenarios]
    base_n = world if world > 1 else 1
    base_tail = _base(p, base_n)
    baseline = p.measured_t_iter - p.measured_tail + base_tail[0]
    err = (baseline - p.measured_t_iter) / p.measured_t_iter if p.measured_t_iter else 0.0
    off = baseline_off(p.measured_t_iter, baseline)
    # a scenario the run cannot tell, or every one when the replay misses the run: a row
    # with the reason in place of its figures
    unknown = {s: off or scenario_unknown(s.bucket_bytes, s.bandwidth_x, layers_known, cost)
               for s in scenarios}
    told = [s for s in scenarios if unknown[s] is None]
    # one GPU: no comm, so backward as it runs with none beside it, and no comm tail
    one_gpu = p.measured_t_iter - p.measured_tail + p.b_end
    preds = {s: _predict(p, s, base_tail) for s in told}
    spread = _intervals(rs, sel, m, world, link_bytes_per_s, on_cpu, told, arrivals,
                        host_bytes_per_s) if intervals else {}
    outcomes = []
    for s in scenarios:
        if unknown[s]:
            n_b = len(_buckets(p, s)) if s.bucket_bytes is None or layers_known else 0
            outcomes.append(Outcome(s, n_b, math.nan, math.nan, math.nan, math.nan,
                                    extrapolated=_extrapolation(s, world, p),
                                    withheld=unknown[s]))
            continue
        n_b, r, t_iter = preds[s]
        lo, hi = spread.get(s, (math.nan, math.nan))
        reference = preds.get(Scenario(s.gpus), (0, r, t_iter))[2]
        if far_off(reference, p.measured_t_iter):
            reference = math.nan
        far = far_off(t_iter, p.measured_t_iter)
        if far:    # its figures are not given, only why
            outcomes.append(Outcome(s, n_b, math.nan, math.nan, math.nan, math.nan,
                                    reference_t_iter=reference,
                                    extrapolated=_extrapolation(s, world, p), withheld=far))
            continue
        outcomes.append(Outcome(s, n_b, r.busy, max(r.comm_end - r.backward_end, 0.0), t_iter,
                                s.gpus * one_gpu / t_iter if t_iter > 0 else 0.0,
                                lo, hi, reference, _extrapolation(s, world, p)))
    return Replay(cost, p.b_end_measured, p.measured_t_iter, baseline, err, layers_known,
                  len(p.units), outcomes, assumptions, p.contention_s, max(world, 1))


def _intervals(rs: RankSteps, sel: np.ndarray, m: ModelResult, world: int,
               link: float | None, on_cpu: bool, scenarios: list[Scenario],
               arrivals: np.ndarray | None, host: float | None
               ) -> dict[Scenario, tuple[float, float]]:
    """95 % intervals of each prediction from the analyzed iterations resampled (the spread
    of the iterations, and of the cost fit on their units)."""
    if sel.size < 4:
        return {}
    rng = np.random.default_rng(0)
    got: dict[Scenario, list[float]] = {s: [] for s in scenarios}
    for _ in range(RESAMPLES):
        pick = np.sort(rng.choice(sel, sel.size, replace=True))
        p = _plan(rs, np.unique(pick), m, world, link, on_cpu, arrivals, host)
        if p is None:
            continue
        p = replace(p, measured_t_iter=float(np.mean(rs.terms["t_iter"][pick])))
        base = _base(p, world if world > 1 else 1)
        for s in scenarios:
            got[s].append(_predict(p, s, base)[2])
    return {s: (float(np.percentile(v, 2.5)), float(np.percentile(v, 97.5)))
            for s, v in got.items() if len(v) >= RESAMPLES // 2}
