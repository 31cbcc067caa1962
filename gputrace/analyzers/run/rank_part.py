"""One rank's part of the analysis: what its own rows give (RankPart), computed where the
rank is read (this process or a worker's), and its what-if replay and speedup once the last
rank's arrival at each comm unit is known (analyzers.combine gathers the parts)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from gputrace.analyzers.core import collective_totals as ct
from gputrace.analyzers.core import collectives as col
from gputrace.analyzers.core import frame as fr
from gputrace.analyzers.core.clocks import UnitTimes
from gputrace.analyzers.core.detail import (
    IterationSeries,
    IterationTimeline,
    iteration_series,
    iteration_timeline,
    representative,
)
from gputrace.analyzers.core.model import ModelResult, Speedup, build_model, speedup, unit_waits
from gputrace.analyzers.core.overlap import EMPTY as EMPTY_UNION
from gputrace.analyzers.core.overlap import summary as _overlap
from gputrace.analyzers.core.results import Stat, _stat
from gputrace.analyzers.core.stalls import findings as stall_findings
from gputrace.analyzers.core.steps import (
    PARALLEL_TERMS,
    TERMS,
    RankSteps,
    analyze_rank,
    counted_iteration,
    warmup_skip,
)
from gputrace.analyzers.extras import goodput as gp
from gputrace.analyzers.extras import held
from gputrace.analyzers.extras import recompute as rcp
from gputrace.analyzers.extras import throughput as tput
from gputrace.analyzers.extras.goodput_findings import findings as gp_findings
from gputrace.analyzers.extras.window import span_series
from gputrace.analyzers.findings.rules import Finding
from gputrace.analyzers.parallel import registry
from gputrace.analyzers.parallel.ddp.findings_replay import _extra_findings
from gputrace.analyzers.parallel.ddp.replay import Replay, Scenario, replay, why_no_replay
from gputrace.analyzers.parallel.ddp.timeline_comm import with_collectives
from gputrace.analyzers.parallel.sharded import sharded as shd
from gputrace.analyzers.parallel.sharded.shardinputs import Inputs as ShardInputs
from gputrace.analyzers.parallel.sharded.shardinputs import iteration_of
from gputrace.analyzers.run.packed import Packed, pack, unpacked
from gputrace.analyzers.run.reading import _give_back
from gputrace.trace.ranked import RankSource, read_rank


@dataclass(frozen=True)
class Options:
    """What the per-rank analysis needs besides the rank's rows (plain data: it travels to
    worker processes)."""

    skip: int | None
    gpus: tuple[int, ...]
    link_bytes_per_s: float | None
    shared_io: bool
    what_if: tuple[Scenario, ...]
    detail: bool
    world: int
    host_bytes_per_s: float | None = None
    engine: tuple[tuple[str, Any], ...] = ()   # a training engine's settings (DeepSpeed's)
    calibration: Any = None   # another run of a pipeline (pp_whatif.Calibration)
    batch: tuple[int | None, int | None] = (None, None)   # samples per forward, tokens each
    disk_write_bytes_per_s: float | None = None   # the probe's, beside a checkpoint's rate
    windowed: bool = False        # a windowed recording: each rank's whole run kept


@dataclass(frozen=True)
class RankPart:
    """What one rank's own rows give: its analysis but for what needs the other ranks or
    its host's samples (the wait for peers in comm and what depends on it: the replay and
    speedup; bandwidth, findings, clock alignment). `steps` is the rank's per-iteration
    summary (no spans), for that second part: held packed (`packed`, analyzers.run.packed)
    while the other ranks are analyzed, unpacked each time it is read."""

    rank: int
    host: str
    iterations: int
    warmup_skipped: int
    synthetic: bool
    breakdown: dict[str, Stat]
    comm: dict[str, float]
    io: dict[str, float]
    comm_exposed_s: float
    model: ModelResult
    findings: list[Finding]
    kept_steps: RankSteps | Packed[RankSteps]
    devices: tuple[int, ...]      # the GPUs its records name
    analyzed: tuple[int, int, int] | None   # (first start, last end, iterations) analyzed
    window: tuple[int, int]       # first start, last end of every iteration
    series: IterationSeries | None = None
    timeline: IterationTimeline | None = None
    throughput: tput.Throughput | None = None
    collectives: ct.Collectives = field(default_factory=ct.Collectives)
    sharded: shd.Sharded | None = None
    shard_inputs: ShardInputs | None = None   # what the sharded analysis reads, kept small
    dims: dict[str, Any] = field(default_factory=dict)     # parallel.registry's rank parts
    degrees: dict[str, int] = field(default_factory=dict)  # dimension -> its group's size
    groups: dict[str, dict[str, Any]] = field(default_factory=dict)  # registry.groups
    left_out: int | None = None   # the analyzed iteration whose FLOPs were counted (its index)
    recompute: rcp.Recompute | None = None   # the forward recomputed in the backward
    goodput: gp.Goodput | None = None   # the whole run: its training share, its badput
    # kept for the sections beside the analysis (analyzers.extras.held): its `flops` rows
    # with its layers' times, and a windowed recording's whole run (window.span_series)
    flops: tuple[held.FlopsRow, ...] = ()
    run_series: dict[str, np.ndarray] | None = None
    device_busy: dict[str, float] | None = None   # a GPU trace's, per analyzed iteration

    @property
    def sel(self) -> np.ndarray:
        sel = np.arange(self.warmup_skipped, self.iterations)
        return sel if self.left_out is None else sel[sel != self.left_out]

    @property
    def steps(self) -> RankSteps:
        return unpacked(self.kept_steps)

    def packed(self) -> RankPart:
        """The part with its steps packed: a tenth to a fifth of its size to hold."""
        k = self.kept_steps
        return self if isinstance(k, Packed) else replace(self, kept_steps=pack(k))

    @property
    def all_units(self) -> UnitTimes:
        """Every iteration's units, for clock alignment (made when asked: the arrays of
        `steps.units` but for the iteration's step, 8 bytes a unit no part keeps)."""
        rs = self.steps
        u = rs.units
        return UnitTimes(rs.iterations.step[u.it], u.index, u.start, u.end)


@dataclass(frozen=True)
class FramePart:
    """The ranks of one frame, its samples by host (held packed: `samples` unpacks them),
    and what it keeps of its samples and instants for the sections beside the analysis
    (held.keep) with the ranks its rows carry."""

    ranks: list[RankPart]
    hosts: dict[str, dict[str, fr.Samples]] | Packed[dict[str, dict[str, fr.Samples]]]
    rows: Any = None          # a small pyarrow Table, or None
    present: tuple[int, ...] = ()

    @property
    def samples(self) -> dict[str, dict[str, fr.Samples]]:
        return unpacked(self.hosts)


def rank_steps(sp: fr.Spans, cr: col.Rows | None = None) -> RankSteps:
    """One rank's per-iteration terms as its analysis takes them (the collectives that stood
    in a phase are exposed comm, not the phase's time): `cr`, its collective rows."""
    cr = col.rows(sp) if cr is None else cr
    return analyze_rank(col.for_model(sp, cr), col.stood(sp, cr), col.not_units(sp, cr),
                        col.stood_by_dim(sp, cr), cr)


def analyze_spans(sp: fr.Spans, o: Options) -> RankPart:
    """Everything one rank's spans give on their own: a pure function of them."""
    cr = col.rows(sp)
    msp = col.for_model(sp, cr)
    rs = rank_steps(sp, cr)
    good = gp.of_rank(sp, rs.iterations)
    extra = _extra_findings(sp, rs) + stall_findings(rs)
    n = rs.iterations.start.size
    skipped = warmup_skip(n, o.skip)
    sel = np.arange(skipped, n)
    left = counted_iteration(sp, rs.iterations, sel)
    if left is not None:
        sel = sel[sel != left]
    colls = shd.summarize_rank(sp, cr, rs, sel)
    dims = registry.rank_parts(registry.RankView(sp, cr, rs, sel, o.world,
                                                 o.link_bytes_per_s, dict(o.engine)))
    inside = np.isin(iteration_of(rs, sp.start[cr.idx]), sel) if cr.n else None
    fs = dims.pop("fsdp", None)          # sharded data parallelism: its model is the rank's
    sharded = fs.sharded if fs is not None else None
    model = build_model(rs, sel)
    kinds = col.unit_kinds(msp, cr, rs.iterations.start)
    if kinds:
        model = replace(model, units=[replace(u, kind=kinds.get(u.index, u.kind))
                                      for u in model.units])
    comm = _overlap(rs.comm, sel)
    if sharded is not None:
        model, comm = sharded.model, sharded.overlap
    timeline = iteration_timeline(sp, rs, representative(rs, sel)) if o.detail and n else None
    if timeline is not None:
        timeline = with_collectives(timeline, sp, cr)
    its = rs.iterations
    return RankPart(
        rank=sp.rank, host=sp.host, iterations=int(n), warmup_skipped=skipped,
        synthetic=its.synthetic,
        breakdown={k: _stat(rs.terms[k][sel]) for k in (*TERMS, *PARALLEL_TERMS)
                   if k in rs.terms},
        comm=comm, io=_overlap(rs.io, sel),
        comm_exposed_s=comm["exposed_s"],
        # the compute union served the hidden-vs-exposed comm above; kept, it would be the
        # largest part of every rank's part (as big as its GPU records) until the end; the
        # per-iteration layer times served the model and the recompute above (a dict per
        # iteration each, empty or not: 64 KB of a rank's 380 KB at 448 iterations)
        model=model, findings=extra + gp_findings(good, o.disk_write_bytes_per_s),
        kept_steps=replace(rs, compute=EMPTY_UNION, layer_backward_s=[], layer_recompute_s=[]),
        devices=tuple(int(d) for d in np.unique(sp.device[sp.on_gpu()])),
        analyzed=(int(its.start[skipped]), int(its.end[n - 1]), int(n - skipped))
        if sel.size else None,
        window=(int(its.start[0]), int(its.end[-1])) if n else (0, 0),
        series=iteration_series(rs, skipped, left) if o.detail else None, timeline=timeline,
        collectives=colls, sharded=sharded, shard_inputs=fs.inputs if fs is not None else None,
        dims=dims, degrees=registry.degrees(cr, inside), groups=registry.groups(cr, inside),
        throughput=tput.rank(sp, its.start, its.end, sel, float(rs.terms["t_iter"][sel].mean())
                             if sel.size else 0.0, *o.batch), left_out=left,
        recompute=rcp.summarize(sp, rs.recompute_s, rs.layer_recompute_s, rs.terms["t_b"], sel),
        goodput=good, flops=held.flops_rows(sp, skipped, left),
        device_busy=_device_busy(rs.device_busy_s, sel, rs.terms["t_iter"]),
        run_series=span_series(sp) if o.windowed else None)


def _device_busy(b: np.ndarray | None, sel: np.ndarray, t_iter: np.ndarray
                 ) -> dict[str, float] | None:
    """A GPU trace's device busy and idle time per analyzed iteration."""
    if b is None or not sel.size:
        return None
    busy = float(np.mean(b[sel]))
    return {"busy_s": busy, "idle_s": max(float(np.mean(t_iter[sel])) - busy, 0.0)}


def _fsdp_part(p: RankPart, o: Options) -> Any:
    from gputrace.analyzers.parallel import fsdp

    return fsdp.Part(p.shard_inputs, p.sharded, dict(o.engine))


def analyze_frame(f: fr.Frame, o: Options) -> FramePart:
    """The ranks of a frame, each freed once it is summarized."""
    parts = []
    for r in list(f.ranks):
        sp = f.ranks.pop(r)
        parts.append(analyze_spans(sp, o).packed())
        del sp
    return FramePart(parts, pack(f.hosts) if f.hosts else f.hosts, f.others, f.present)


def analyze_source(source: RankSource, drop_unranked: bool, o: Options) -> FramePart:
    """One rank read from its files and analyzed: the task a worker process (or a Dask or
    Ray worker that sees the same files) runs."""
    _give_back()
    cols = read_rank(source, fr.COLUMNS)
    return analyze_frame(fr.build(cols, None, drop_unranked=drop_unranked, others=held.keep),
                         o)


def replay_rank(p: RankPart, arrivals: np.ndarray | Packed[np.ndarray] | None, world: int,
                o: Options, shared: str | None, intervals: bool = False
                ) -> tuple[Replay | None, Speedup, str | None]:
    """A rank's what-if replay and speedup, given when the last rank arrived at each of its
    comm units (`arrivals`, packed or not): a pure function of its part (run in the workers
    too)."""
    rs, sel, arrivals = p.steps, p.sel, unpacked(arrivals)
    if p.sharded is not None:
        return None, p.sharded.speedup, ("a sharded (FSDP) run: its what-ifs replay the "
                                         "sharded timeline (see sharded)")
    rp = replay(rs, sel, p.model, world, list(o.gpus), o.link_bytes_per_s, list(o.what_if),
                intervals=intervals, arrivals=arrivals, host_bytes_per_s=o.host_bytes_per_s)
    sp_ = speedup(p.model, world, list(o.gpus), o.link_bytes_per_s, o.shared_io,
                  float(sum(rs.layer_bytes.values())),
                  contention_s=rp.contention_s if rp is not None else 0.0,
                  shared=shared, unit_waits=unit_waits(rs, sel, arrivals))
    why = None if rp is not None else why_no_replay(rs, sel, world, o.link_bytes_per_s)
    return rp, sp_, why
