"""Analyzers: pure functions from a loaded trace to frozen results. No I/O, no printing."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from gputrace import progress
from gputrace.analyzers import collective_totals as ct
from gputrace.analyzers import collectives as col
from gputrace.analyzers import frame as fr
from gputrace.analyzers import goodput as gp
from gputrace.analyzers import invariants, sanity, zero_whatif
from gputrace.analyzers import recompute as rcp
from gputrace.analyzers import sharded as shd
from gputrace.analyzers import throughput as tput
from gputrace.analyzers.bandwidth import _peaks, analyze_bandwidth, bandwidth_series
from gputrace.analyzers.clocks import UnitTimes, estimate
from gputrace.analyzers.detail import (
    IterationSeries,
    IterationTimeline,
    RankDetail,
    iteration_series,
    iteration_timeline,
    representative,
    unit_durations,
)
from gputrace.analyzers.findings import Finding, find, framework_of
from gputrace.analyzers.findings_comm import shd_findings
from gputrace.analyzers.findings_replay import _agree, _extra_findings, _replay_findings
from gputrace.analyzers.model import ModelResult, Speedup, build_model, speedup, unit_waits
from gputrace.analyzers.outliers import find_outliers
from gputrace.analyzers.overlap import EMPTY as EMPTY_UNION
from gputrace.analyzers.overlap import summary as _overlap
from gputrace.analyzers.parallel import registry
from gputrace.analyzers.parallel.findings import findings as par_findings
from gputrace.analyzers.ranks import (
    _comm_wait,
    _host_bandwidth,
    _link_from_probe,
    _md_world,
    _shared,
)
from gputrace.analyzers.reading import _frames, _give_back, parallel_worth_it  # noqa: F401
from gputrace.analyzers.replay import Replay, Scenario, replay, why_no_replay
from gputrace.analyzers.results import Analysis, NothingToAnalyze, RankAnalysis, Stat, _stat
from gputrace.analyzers.shardinputs import Inputs as ShardInputs
from gputrace.analyzers.shardinputs import iteration_of
from gputrace.analyzers.stalls import findings as stall_findings
from gputrace.analyzers.steps import (
    PARALLEL_TERMS,
    TERMS,
    RankSteps,
    analyze_rank,
    counted_iteration,
    warmup_skip,
)
from gputrace.analyzers.timeline_comm import with_collectives
from gputrace.trace.ranked import RankedTrace, RankSource, read_rank


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


@dataclass(frozen=True)
class RankPart:
    """What one rank's own rows give: its analysis but for what needs the other ranks or
    its host's samples (the wait for peers in comm and what depends on it: the replay and
    speedup; bandwidth, findings, clock alignment). `steps` is the rank's per-iteration
    summary (no spans), for that second part."""

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
    steps: RankSteps
    devices: tuple[int, ...]      # the GPUs its records name
    all_units: UnitTimes          # every iteration's units, for clock alignment
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

    @property
    def sel(self) -> np.ndarray:
        sel = np.arange(self.warmup_skipped, self.iterations)
        return sel if self.left_out is None else sel[sel != self.left_out]


@dataclass(frozen=True)
class FramePart:
    """The ranks of one frame, and its samples by host."""

    ranks: list[RankPart]
    hosts: dict[str, dict[str, fr.Samples]]


def analyze_spans(sp: fr.Spans, o: Options) -> RankPart:
    """Everything one rank's spans give on their own: a pure function of them."""
    cr = col.rows(sp)
    msp = col.for_model(sp, cr)
    rs = analyze_rank(msp, col.stood(sp, cr), col.not_units(sp, cr), col.stood_by_dim(sp, cr))
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
    u = rs.units
    its = rs.iterations
    return RankPart(
        rank=sp.rank, host=sp.host, iterations=int(n), warmup_skipped=skipped,
        synthetic=its.synthetic,
        breakdown={k: _stat(rs.terms[k][sel]) for k in (*TERMS, *PARALLEL_TERMS)
                   if k in rs.terms},
        comm=comm, io=_overlap(rs.io, sel),
        comm_exposed_s=comm["exposed_s"],
        # the compute union served the hidden-vs-exposed comm above; kept, it would be the
        # largest part of every rank's part (as big as its GPU records) until the end
        model=model, findings=extra + gp.findings(good, o.disk_write_bytes_per_s),
        steps=replace(rs, compute=EMPTY_UNION),
        devices=tuple(int(d) for d in np.unique(sp.device[sp.on_gpu()])),
        all_units=UnitTimes(its.step[u.it], u.index, u.start, u.end),
        analyzed=(int(its.start[skipped]), int(its.end[n - 1]), int(n - skipped))
        if sel.size else None,
        window=(int(its.start[0]), int(its.end[-1])) if n else (0, 0),
        series=iteration_series(rs, skipped, left) if o.detail else None, timeline=timeline,
        collectives=colls, sharded=sharded, shard_inputs=fs.inputs if fs is not None else None,
        dims=dims, degrees=registry.degrees(cr, inside), groups=registry.groups(cr, inside),
        throughput=tput.rank(sp, its.start, its.end, sel, float(rs.terms["t_iter"][sel].mean())
                             if sel.size else 0.0, *o.batch), left_out=left,
        recompute=rcp.summarize(sp, rs.recompute_s, rs.layer_recompute_s, rs.terms["t_b"], sel),
        goodput=good)


def _fsdp_part(p: RankPart, o: Options) -> Any:
    from gputrace.analyzers.parallel import fsdp

    return fsdp.Part(p.shard_inputs, p.sharded, dict(o.engine))


def analyze_frame(f: fr.Frame, o: Options) -> FramePart:
    """The ranks of a frame, each freed once it is summarized."""
    parts = []
    for r in list(f.ranks):
        sp = f.ranks.pop(r)
        parts.append(analyze_spans(sp, o))
        del sp
    return FramePart(parts, f.hosts)


def analyze_source(source: RankSource, drop_unranked: bool, o: Options) -> FramePart:
    """One rank read from its files and analyzed: the task a worker process (or a Dask or
    Ray worker that sees the same files) runs."""
    _give_back()
    cols = read_rank(source, fr.COLUMNS)
    return analyze_frame(fr.build(cols, None, drop_unranked=drop_unranked), o)


def replay_rank(p: RankPart, arrivals: np.ndarray | None, world: int, o: Options,
                shared: str | None, intervals: bool = False
                ) -> tuple[Replay | None, Speedup, str | None]:
    """A rank's what-if replay and speedup, given when the last rank arrived at each of its
    comm units (`arrivals`): a pure function of its part (run in the workers too)."""
    rs, sel = p.steps, p.sel
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


def analyze(trace: Any, *, skip: int | None = None, gpus: Sequence[int] = (2, 4, 8, 16),
            link_bytes_per_s: float | None = None, shared_io: bool = False,
            what_if: Sequence[Scenario] = (), consume: bool = False,
            detail: bool = False, executor: Executor | None = None,
            align: bool = True, host_bytes_per_s: float | None = None,
            calibration: Any = None, batch: tuple[int | None, int | None] = (None, None)
            ) -> Analysis:
    """Analyze a loaded trace (gputrace.trace.Trace, or a RankedTrace read one rank at a
    time); `what_if` adds replay scenarios; `host_bytes_per_s`: the host's own gloo
    all-reduce bus bandwidth (default: the probe's, when it ran gloo), the least CPU a byte of
    comm on the CPU costs. `consume` hands a Trace's table over
    (trace.table becomes None), so its columns are freed one by one as they are converted:
    the command line's peak memory. `detail` keeps, per rank, what a report draws
    (RankAnalysis.detail): per-iteration figures, the timeline of a median iteration and
    bandwidth over time. `executor` (a concurrent.futures Executor: a process pool, Dask's
    or Ray's) analyzes a RankedTrace's ranks in its workers, each reading its own rank from
    the files. Host clocks are aligned on the comm units every rank ends at once (`align`
    False: the offsets are reported, not applied). `calibration`: another run of the same
    pipeline at another microbatch count (pp_whatif.calibration_of), for its what-ifs;
    `batch`: samples per forward and tokens per sample where the trace does not tell."""
    md = trace.metadata if isinstance(trace.metadata, dict) else {}
    probe = md.get("probe")
    if link_bytes_per_s is None:
        link_bytes_per_s = _link_from_probe(probe)
    world = _md_world(md)
    opts = Options(skip, tuple(gpus), link_bytes_per_s, shared_io, tuple(what_if), detail, 1,
                   host_bytes_per_s or _host_bandwidth(md),
                   tuple(sorted(zero_whatif.settings(md).items())), calibration, batch,
                   _peaks(probe).get("disk_write"))
    parts: list[FramePart] = []
    if isinstance(trace, RankedTrace):
        ranked = any(r >= 0 for r in trace.groups)
        opts = replace(opts, world=max(sum(r >= 0 for r in trace.groups), world, 1))
        if executor is not None:
            tasks = [(trace.source(r), ranked and r < 0) for r in trace.ranks]
            parts = list(progress.each(executor.map(analyze_source, *zip(*tasks, strict=True),
                                                    [opts] * len(tasks)),
                                       "analyzing ranks", len(tasks)))
        else:
            parts = [analyze_frame(f, opts) for f in progress.each(
                _frames(trace, consume), "analyzing ranks", len(trace.ranks))]
    else:
        for f in _frames(trace, consume):
            opts = replace(opts, world=max(len(f.ranks), world, opts.world))
            parts.append(analyze_frame(f, opts))
    return combine(parts, md, opts, probe, align, executor)


def combine(parts: list[FramePart], md: dict[str, Any], opts: Options, probe: Any,
            align: bool = True, executor: Executor | None = None) -> Analysis:
    """The analysis of a run from its ranks' parts: the wait for peers in comm (on host
    clocks aligned), each rank's replay and speedup given it (in `executor`'s workers when
    given), its bandwidth (its host's samples) and findings, host clock offsets, outliers."""
    ranks = {p.rank: p for fp in parts for p in fp.ranks}
    if not ranks:
        raise NothingToAnalyze("the trace has no spans (no iterations or phases) to analyze")
    hosts = fr.merge_hosts([fp.hosts for fp in parts])
    world = max(len(ranks), opts.world, 1)
    clock = estimate({r: (p.host, p.all_units) for r, p in ranks.items()}, align) \
        if len({p.host for p in ranks.values()}) > 1 else None
    steps = {r: p.steps for r, p in ranks.items()}
    sels = {r: p.sel for r, p in ranks.items()}
    offsets = {r: clock.offset_ns(p.host) for r, p in ranks.items()} if clock else {}
    waits, arrivals = _comm_wait(steps, sels, offsets) if len(ranks) > 1 else ({}, {})
    rv = registry.RunView(world, opts.link_bytes_per_s, arrivals, steps, sels,
                          opts.calibration, offsets)
    degrees, deg_check = _degrees(ranks, world)
    if deg_check is not None:   # a dimension the groups cannot hold: its claims withheld
        ranks = {r: replace(p, dims={d: v for d, v in p.dims.items() if d in degrees})
                 for r, p in ranks.items()}
    parts_of = {r: p.dims for r, p in ranks.items()}
    for r, p in ranks.items():
        if p.sharded is not None:
            parts_of[r] = {**p.dims, "fsdp": _fsdp_part(p, opts)}
    parallel = registry.runs(parts_of, rv)
    # FSDP: its analysis again, knowing when the last rank came
    for r, sh in (parallel.pop("fsdp", None) or {}).items():
        ranks[r] = replace(ranks[r], sharded=sh, model=sh.model)
    shared = _shared(steps, {r: p.devices for r, p in ranks.items()}, md)
    groups = {d: g for d, g in registry.merge_groups([p.groups for p in ranks.values()]).items()
              if deg_check is None or d in degrees}
    beyond = registry.beyond_dp(degrees)
    missing = None if beyond else sanity.comm_missing(list(ranks.values()), world, md)
    no_dp = registry.why_no_dp_prediction(degrees) if beyond else None
    order = list(ranks)
    args = ([ranks[r] for r in order], [arrivals.get(r) for r in order],
            [world] * len(order), [opts] * len(order), [shared] * len(order))
    if missing or no_dp:   # nothing to predict from: say so, never scale a comm never seen
        why_not = missing or no_dp
        done = [(None, replace(speedup(ranks[r].model, world, []), points=[],
                               unavailable=why_not),
                 why_not if no_dp else
                 f"{why_no_replay(ranks[r].steps, ranks[r].sel, world, opts.link_bytes_per_s)}"
                 f"; {missing}") for r in order]
    else:
        done = list(progress.each(executor.map(replay_rank, *args)
                                  if executor is not None and len(order) > 1
                                  else map(replay_rank, *args), "replaying ranks", len(order)))
    replays = dict(zip(order, done, strict=True))
    out: dict[int, RankAnalysis] = {}
    for r, p in ranks.items():
        rp, sp_, why = replays[r]
        samples = hosts.get(p.host)
        if samples is None and len(hosts) == 1:
            samples = next(iter(hosts.values()))   # samples recorded without a host name
        bw = None
        if samples and p.analyzed:
            lo, hi, n = p.analyzed
            bw = analyze_bandwidth(samples, lo, hi, n, p.io["total_s"] * n, probe)
        rd = None
        if opts.detail and p.series is not None:
            lo, hi = p.window
            rd = RankDetail(p.series, p.timeline,
                            bandwidth_series(samples, lo, hi, probe) if samples else [], lo,
                            unit_durations(p.steps, p.sel))
        w = waits.get(r)
        more = {"findings": p.findings + _replay_findings(rp, world)
                + shd_findings(p, missing)
                + par_findings(p.dims, parallel, p.breakdown["t_iter"].mean),
                "framework": framework_of(md)}
        out[r] = RankAnalysis(
            rank=r, iterations=p.iterations, warmup_skipped=p.warmup_skipped,
            synthetic_iterations=p.synthetic, breakdown=p.breakdown, comm=p.comm, io=p.io,
            model=p.model, speedup=sp_, bandwidth=bw,
            findings=_agree(find(p.model, p.comm, p.io, bw, more), rp, world),
            comm_wait_s=w[0] if w else None, comm_transfer_s=w[1] if w else None,
            replay=rp, detail=rd, replay_unavailable=why, host=p.host,
            collectives=p.collectives, comm_missing=missing, sharded=p.sharded,
            dims=p.dims, degrees=degrees, parallel=parallel, groups=groups,
            dimensions=registry.describe(degrees, world), throughput=p.throughput,
            flops_left_out=None if p.left_out is None else int(p.steps.iterations.step[p.left_out]),
            recompute=rcp.seen(p.recompute, md), device_busy=_device_busy(p),
            goodput=p.goodput)
    slowest = max(out, key=lambda r: out[r].breakdown["t_iter"].mean)
    main = out[slowest]
    if main.replay is not None:
        # the shown rank's predictions get their intervals (iterations resampled)
        rp, _, _ = replay_rank(ranks[slowest], arrivals.get(slowest), world, opts, shared,
                               intervals=True)
        out[slowest] = replace(main, replay=rp)
    figures = {r: {**{k: p.breakdown[k].mean for k in TERMS}, "comm_exposed": p.comm_exposed_s}
               for r, p in ranks.items()}
    outliers, told = find_outliers(figures, {r: p.host for r, p in ranks.items()})
    return invariants.check(
        Analysis(out, slowest, world, dict(md), clock=clock, outliers=outliers,
                 slowest_why=told, throughput=tput.job(
                     {r: p.throughput for r, p in ranks.items()}, world, degrees)),
        opts.what_if, [deg_check] if deg_check else [])


def _device_busy(p: RankPart) -> dict[str, float] | None:
    """A GPU trace's device busy and idle time per analyzed iteration."""
    b = p.steps.device_busy_s
    if b is None or not p.sel.size:
        return None
    busy = float(np.mean(b[p.sel]))
    return {"busy_s": busy, "idle_s": max(p.breakdown["t_iter"].mean - busy, 0.0)}


def _degrees(ranks: dict[int, RankPart], world: int) -> tuple[dict[str, int], Any]:
    """The run's dimensions (each one's largest group seen on any rank) that its world
    size can hold, and the check that withheld the others (invariants.degrees)."""
    deg: dict[str, int] = {}
    moved: dict[str, float] = {}
    for p in ranks.values():
        for d, g in p.degrees.items():
            deg[d] = max(deg.get(d, 0), g)
        for k in p.collectives.kinds:
            moved[k.dim] = moved.get(k.dim, 0.0) + k.nbytes
    return invariants.degrees(deg, world, moved)
