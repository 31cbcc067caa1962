"""Sharded data parallel (FSDP2 `fully_shard`, FSDP1): per unit and iteration the forward
all-gather, the backward re-gather and the reduce-scatter; hidden vs exposed per unit (an
all-gather is exposed by the time its unit's compute waited for it, a reduce-scatter by the
time the step waited for it); the model of a sharded iteration, Case 1 / Case 2 per side,
the speedup for N GPUs and what-ifs replayed on the measured timeline (shardsim)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from gputrace.analyzers.core import collectives as col
from gputrace.analyzers.core.model import (
    ModelResult,
    Speedup,
    SpeedupPoint,
    UnitStats,
    checked,
    mean_terms,
)
from gputrace.analyzers.core.overlap import summary
from gputrace.analyzers.core.steps import RankSteps
from gputrace.analyzers.findings.sanity import far_off
from gputrace.analyzers.parallel.sharded import shardsettings, zero_run
from gputrace.analyzers.parallel.sharded import shardsim as sim
from gputrace.analyzers.parallel.sharded import zero_whatif as zw
from gputrace.analyzers.parallel.sharded.shardinputs import Inputs, summarize_rank  # noqa: F401 (here too)
from gputrace.analyzers.parallel.sharded.shardtimeline import timelines
from gputrace.analyzers.parallel.sharded.shardwhatif import WhatIf, mean_ci

HIDDEN = 0.1          # a collective is hidden when the job waited less than this share of it


@dataclass(frozen=True)
class UnitRow:
    """One FSDP unit's collective of one role, means per analyzed iteration."""

    unit: int
    name: str
    role: str
    kind: str
    count: float
    nbytes: float
    start_s: float       # from iteration start
    end_s: float
    duration_s: float
    exposed_s: float
    prefetched: float    # fraction issued by prefetch


@dataclass(frozen=True)
class Sharded:
    strategy: str                 # fsdp2 / fsdp1
    world: int
    units: list[UnitRow]
    per_iteration: dict[str, float]       # role -> collectives per iteration
    kinds: dict[str, float]               # kind -> collectives per iteration
    exposed: dict[str, float]             # forward / backward / total exposed s per iteration
    cases: dict[str, int]                 # forward / backward -> 1 or 2
    exposed_units: dict[str, list[int]]   # side -> units whose collective was exposed
    prefetch: dict[str, int]              # depth per side: as set (settings), else measured
    reshard_after_forward: bool           # the backward re-gathered
    model: ModelResult
    overlap: dict[str, float]
    speedup: Speedup
    what_if: list[WhatIf]
    baseline_t_iter: float
    baseline_error: float
    assumptions: list[str] = field(default_factory=list)
    # exposed s in each analyzed iteration (their mean: exposed["total_s"])
    exposed_series: np.ndarray = field(default_factory=lambda: np.zeros(0))
    # FSDP2's settings read from the job (None: not recorded)
    settings: shardsettings.Settings | None = None
    # each side's (forward / backward / update) exposed s in each analyzed iteration
    exposed_sides: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return LABELS.get(self.strategy, self.strategy.upper())

    def headline(self) -> str:
        ag = self.kinds.get("all_gather", 0.0)
        rs = self.kinds.get("reduce_scatter", 0.0)
        ar = self.kinds.get("all_reduce", 0.0)
        if self.strategy.startswith("fsdp"):
            more = f" and {_n(ar)} all-reduces" if ar else ""
            what = f"{_n(ag)} all-gathers and {_n(rs)} reduce-scatters{more}"
        else:   # ZeRO: the kinds it ran (stages 1 and 2 may all-reduce the gradients)
            what = " and ".join(f"{_n(n)} {k}{'' if _n(n) == '1' else 's'}" for n, k in
                                ((ag, "all-gather"), (rs, "reduce-scatter"),
                                 (ar, "all-reduce")) if n)
        return (f"{self.label}, {self.world} rank{'s' if self.world != 1 else ''}: "
                f"{what} per iteration, {self.exposed['total_s'] * 1e3:.1f} ms exposed")


LABELS = {"fsdp2": "FSDP", "fsdp1": "FSDP (FullyShardedDataParallel)",
          "zero0": "DeepSpeed ZeRO-0 (data parallel)",
          "zero1": "DeepSpeed ZeRO-1", "zero2": "DeepSpeed ZeRO-2", "zero3": "DeepSpeed ZeRO-3"}


def _n(x: float) -> str:
    return f"{x:.0f}" if abs(x - round(x)) < 0.05 else f"{x:.1f}"


def _unit_rows(facts: dict, cr: col.Rows, rs: RankSteps, sel: np.ndarray) -> list[UnitRow]:
    it = facts["it"]
    inside = np.isin(it, sel)
    n_it = max(sel.size, 1)
    t0 = rs.iterations.start[np.clip(it, 0, None)]
    groups: dict[tuple[int, str], list[int]] = {}
    for j in np.flatnonzero(inside).tolist():
        groups.setdefault((int(facts["unit"][j]), facts["role"][j]), []).append(j)
    out = []
    for (u, role), js in groups.items():
        a = np.array(js)
        rows = facts["rows"][a]
        out.append(UnitRow(
            u, next((cr.unit[r] for r in rows if cr.unit[r] is not None), "") or "",
            role, cr.kind[rows[0]], a.size / n_it, float(np.nansum(cr.nbytes[rows])) / n_it,
            float(np.mean((facts["start"][a] - t0[a]) / 1e9)),
            float(np.mean((facts["end"][a] - t0[a]) / 1e9)),
            float(np.mean((facts["end"][a] - facts["start"][a]) / 1e9)),
            float(np.sum(facts["exposed"][a]) / 1e9) / n_it,
            float(np.mean(cr.prefetch[rows]))))
    out.sort(key=lambda r: r.start_s)
    return out


def _depth(cr: col.Rows, facts: dict, role: str) -> int:
    js = [j for j, r in enumerate(facts["role"]) if r == role]
    if not js:
        return 1 if role == "reshard_gather" else 0
    return 1 if np.mean(cr.prefetch[facts["rows"][js]]) > 0.5 else 0


def _link_cost(facts: dict, cr: col.Rows, inside: np.ndarray) -> zw.Cost | None:
    """The service time of the run's sharded collectives as a fixed part per call and a
    part per byte (a least-squares line through their sizes and service times, wherever
    the sizes differ): gloo's calls on the CPU cost ~1 ms whatever their bytes, which a
    slower link leaves as they are (bench/README.md). Where no line fits (one size, or a
    cost that does not grow with the bytes), the fixed part is 0."""
    rows = facts["rows"][inside]
    # no collectives of a few bytes given: where no line fits, alpha comes out 0
    return zw.fit(facts["svc"][inside], cr.nbytes[rows], np.zeros(0), np.zeros(0), least=0.0)


def _ring(n: int) -> float:
    return (n - 1) / n if n > 1 else 0.0


def analyze_sharded(si: Inputs, rs: RankSteps, sel: np.ndarray, world: int,
                    link_bytes_per_s: float | None = None,
                    gpus: Sequence[int] = (2, 4, 8, 16),
                    arrive: np.ndarray | None = None, engine: dict | None = None
                    ) -> Sharded | None:
    """The sharded view of one rank (None when it has no FSDP collective in `sel`);
    `arrive`: per comm row, when the last rank arrived at it (from the other ranks);
    `engine`: DeepSpeed's settings (its what-ifs are in them)."""
    cr = si.cr
    strategy = next((f for f in cr.fsdp if f), "")
    # a synchronous gather holds FSDP's compute where issued (ZeRO's replay keeps its own)
    tls, facts, fgathers = timelines(si, rs, sel, arrive, held=strategy.startswith("fsdp"))
    if not tls:
        return None
    n_it = max(len(tls), 1)
    units = _unit_rows(facts, cr, rs, sel)
    # its own group's size (FSDP x TP: the FSDP dimension's, not the run's ranks)
    sizes = [int(g) for g, f in zip(cr.group_size.tolist(), cr.fsdp, strict=True) if g > 0 and f]
    world = max(sizes) if sizes else max(world, 1)
    inside = np.isin(facts["it"], sel)
    roles = np.array(facts["role"])
    per_role = {r: float(np.sum(inside & (roles == r))) / n_it for r in col.ROLES}
    kinds: dict[str, float] = {}
    for j in np.flatnonzero(inside).tolist():
        k = cr.kind[facts["rows"][j]]
        kinds[k] = kinds.get(k, 0.0) + 1.0 / n_it
    exp_f = sum(u.exposed_s for u in units if u.role == "unshard")
    exp_u = sum(u.exposed_s for u in units if u.role == "step_gather")
    exp_b = sum(u.exposed_s for u in units if u.role not in ("unshard", "step_gather"))
    exposed = {"forward_s": exp_f, "backward_s": exp_b, "update_s": exp_u,
               "total_s": exp_f + exp_b + exp_u}
    per_it = np.bincount(np.searchsorted(sel, facts["it"][inside]), minlength=sel.size,
                         weights=facts["exposed"][inside] / 1e9)[:sel.size]
    side = np.where(roles == "unshard", "forward",
                    np.where(roles == "step_gather", "update", "backward"))
    per_side = {s: np.bincount(np.searchsorted(sel, facts["it"][inside & (side == s)]),
                               minlength=sel.size,
                               weights=facts["exposed"][inside & (side == s)] / 1e9)[:sel.size]
                for s in ("forward", "backward", "update")}
    ex_units = {
        "forward": sorted({u.unit for u in units if u.role == "unshard"
                           and u.exposed_s > HIDDEN * u.duration_s * u.count}),
        "backward": sorted({u.unit for u in units if u.role == "reshard_gather"
                            and u.exposed_s > HIDDEN * u.duration_s * u.count}),
    }
    fwd_gathers = [u for u in units if u.role == "unshard"]
    first = fwd_gathers[0].unit if fwd_gathers else None
    cases = {"forward": 1 if all(u == first for u in ex_units["forward"]) else 2}
    reduces = [u for u in units if u.role == "reduce_grad"]
    last_red = reduces[-1].unit if reduces else None
    red_exposed = sorted({u.unit for u in reduces if u.unit != last_red
                          and u.exposed_s > HIDDEN * u.duration_s * u.count})
    cases["backward"] = 1 if not ex_units["backward"] and not red_exposed else 2
    ex_units["backward"] = sorted(set(ex_units["backward"]) | set(red_exposed))
    resharded = per_role["reshard_gather"] > 0
    order = list(dict.fromkeys(u.name for u in sorted(units, key=lambda u: u.unit)))
    st = shardsettings.read(si, sel, order) if strategy == "fsdp2" else None
    cost = _link_cost(facts, cr, inside)
    fixed = cost.alpha_s if cost is not None else 0.0
    # the depths the job set, not those guessed from issue order
    depths = (st.prefetch_forward, st.prefetch_backward) if st is not None else \
        (_depth(cr, facts, "unshard"), _depth(cr, facts, "reshard_gather"))
    base = sim.Knobs(*depths, fixed_s=fixed)
    root = first
    kw = {"forward_gathers": None, "root": root}

    def preds(k: sim.Knobs) -> np.ndarray:
        return np.array([sim.predict(tl, k, base, forward_gathers=g, root=root)
                         for tl, g in zip(tls, fgathers, strict=True)])

    base_pred = np.array([tl.t_iter - tl.forward_s - tl.backward_s
                          + (r.forward_s + r.backward_s)
                          for tl in tls for r in [sim.simulate(tl, base, **kw)]])
    measured = float(np.mean([tl.t_iter for tl in tls]))
    baseline = float(np.mean(base_pred))
    err = (baseline - measured) / measured if measured > 0 else 0.0
    assumptions = [
        "collectives of one process group run one after another, in issue order (one channel)",
        "compute between unit boundaries stays as measured; a unit's gather is needed when its "
        "compute begins, its reduce-scatter issued when its backward ends",
        "service times scale with the bytes each rank moves, (N-1)/N of the full parameters; "
        + (f"of each, {fixed * 1e3:.2f} ms (a call's own cost, what a collective of no bytes "
           f"would take: {cost.how}) stays whatever the link, the rest scales inversely with "
           "its bandwidth" if cost is not None and fixed > 0 else
           "they scale inversely with the link bandwidth, a call's own cost with them (not "
           "told apart: no line through the collectives' sizes and times)"),
    ]
    peer = float(np.sum(facts["peer"][inside])) / 1e9 / n_it
    beside = float(np.sum(np.maximum(facts["beside"][inside], 0))) / 1e9 / n_it
    if arrive is not None:
        assumptions.append(
            f"a synchronous collective's wait for the last rank to arrive ({peer * 1e3:.1f} ms "
            "per iteration, measured against the other ranks) is the slower rank's pace: it "
            "stays, as compute, where the collective goes away; only the rest is transfer")
    else:
        assumptions.append("the wait for the last rank inside a collective is not known "
                           "(one rank's trace): it is counted as transfer")
    if beside > 0:
        assumptions.append(
            f"collectives ran beside this rank's compute for {beside * 1e3:.1f} ms per "
            "iteration; on the CPU what they took from compute is not given back")
    else:
        assumptions.append(
            "no collective ran beside this rank's compute (synchronous calls, as gloo's on the "
            "CPU: the issuing thread waits, and bytes move only once every rank is in the "
            "call), so compute between unit boundaries had no comm to give back")
    scen: list[tuple[str, sim.Knobs]] = []
    fsdp = strategy.startswith("fsdp")   # FSDP's own settings; ZeRO's are not these
    if not fsdp:
        pass
    elif st is not None:   # each way some unit was not set
        if resharded and st.resharding:
            scen.append(("reshard_after_forward=False", replace(base, reshard=False)))
        if len(fwd_gathers) > 1 and set(st.keeping) & {u.name for u in fwd_gathers[1:]}:
            scen.append(("reshard_after_forward=True", replace(base, reshard=True)))
    elif resharded:
        scen.append(("reshard_after_forward=False", replace(base, reshard=False)))
    elif len(fwd_gathers) > 1:
        scen.append(("reshard_after_forward=True", replace(base, reshard=True)))
    for d in (0, 1, 2) if fsdp else ():
        if d != base.prefetch_forward:
            scen.append((f"forward prefetch {d}", replace(base, prefetch_forward=d)))
        # FSDP2 prefetches a unit back by default: depth 0 is no setting of it
        if d != base.prefetch_backward and resharded and not (d == 0 and
                                                              strategy == "fsdp2"):
            scen.append((f"backward prefetch {d}", replace(base, prefetch_backward=d)))
    for x in (2.0, 0.5):
        scen.append((f"link x{x:g}", replace(base, bandwidth_x=x)))
    what = [] if fsdp else zero_run.what_ifs(tls, facts, si, arrive, sel, engine or {}, base,
                                             measured, assumptions, world, not rs.gpu)
    for label, k in scen:
        v = preds(k)
        m, lo, hi = mean_ci(v)
        knobs: dict[str, object] = {"prefetch_forward": k.prefetch_forward,
                                    "prefetch_backward": k.prefetch_backward,
                                    "bandwidth_x": k.bandwidth_x, "reshard": k.reshard}
        far = far_off(m, measured)
        if far:    # its figures are not given, only why
            what.append(WhatIf(label, *[math.nan] * 5, knobs, far))   # type: ignore[arg-type]
            continue
        r = [sim.simulate(tl, k, forward_gathers=g, root=root)
             for tl, g in zip(tls, fgathers, strict=True)]
        what.append(WhatIf(label, m, lo, hi,
                           float(np.mean([x.exposed_forward_s + x.exposed_backward_s
                                          for x in r])),
                           float(np.mean([x.comm_s for x in r])), knobs))
    sp_ = _speedup(tls, fgathers, base, root, world, gpus, link_bytes_per_s, assumptions,
                   measured)
    terms = mean_terms(rs, sel)
    ustats = [UnitStats(i, None, u.nbytes / max(u.count, 1e-9), u.start_s, u.start_s, u.end_s,
                        u.duration_s, u.exposed_s <= HIDDEN * u.duration_s * u.count,
                        max(0.0, 1 - u.exposed_s / max(u.duration_s * u.count, 1e-12)),
                        kind=u.kind) for i, u in enumerate(units)]
    model = ModelResult(
        "fsdp", max(cases.values()), None, None, "S", baseline, measured, err, False, None,
        terms, ustats,
        [f"sharded iteration (docs/sharded.md): forward Case {cases['forward']}, backward "
         f"Case {cases['backward']}; replaying the measured timeline gives "
         f"{baseline * 1e3:.1f} ms ({err:+.1%})"])
    # the rank's comm against the compute the terms hold, as a run without sharding's: the
    # time it stood in a collective that is no unit of the sharded model (ZeRO's overflow
    # flag, a loss) is exposed, not hidden for want of a unit to count it in
    ovl = summary(rs.comm, sel)
    return Sharded(strategy, world, units, per_role, kinds, exposed, cases, ex_units,
                   {"forward": base.prefetch_forward, "backward": base.prefetch_backward},
                   resharded, model, ovl, sp_, what, baseline, err, assumptions, per_it, st,
                   per_side)


def _speedup(tls: list[sim.Timeline], fg: list[dict[int, float]], base: sim.Knobs,
             root: int | None, world: int, gpus: Sequence[int], link: float | None,
             assumptions: list[str], measured: float) -> Speedup:
    one = float(np.mean([sim.one_gpu(tl, base) for tl in tls]))
    pts = []
    unavailable = None
    if world < 2:
        unavailable = ("one rank: its collectives move nothing between GPUs, so there is no "
                       "measured transfer to scale")
    else:
        for n in gpus:
            k = replace(base, scale=_ring(n) / _ring(world))
            t = float(np.mean([sim.predict(tl, k, base, forward_gathers=g, root=root)
                               for tl, g in zip(tls, fg, strict=True)]))
            s = n * one / t if t > 0 else 0.0
            r = [sim.simulate(tl, k) for tl in tls]
            pts.append(checked(SpeedupPoint(n, s, s / n, t,
                                            float(np.mean([x.comm_s for x in r]))), measured))
    asm = ["weak scaling: the same batch per GPU, so compute per unit stays",
           f"all-gather and reduce-scatter move (N-1)/N of the full bytes per rank: "
           f"their measured service times at {world} ranks scale by ((N-1)/N)/"
           f"(({world}-1)/{world})"] + assumptions[:2]
    return Speedup("S", world, pts, asm, None, link, 0.0, unavailable)
