"""Analyzers: pure functions from a loaded trace to frozen results. No I/O, no printing."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Executor
from dataclasses import replace
from typing import Any

from gputrace import progress
from gputrace.analyzers.core import frame as fr
from gputrace.analyzers.core.bandwidth import _peaks, analyze_bandwidth, bandwidth_series
from gputrace.analyzers.core.clocks import estimate
from gputrace.analyzers.core.detail import (
    RankDetail,
    unit_durations,
)
from gputrace.analyzers.core.model import speedup
from gputrace.analyzers.core.outliers import find_outliers
from gputrace.analyzers.core.results import Analysis, NothingToAnalyze, RankAnalysis
from gputrace.analyzers.core.steps import (
    TERMS,
)
from gputrace.analyzers.extras import held
from gputrace.analyzers.extras import recompute as rcp
from gputrace.analyzers.extras import throughput as tput
from gputrace.analyzers.findings import invariants, sanity
from gputrace.analyzers.findings.findings_comm import shd_findings
from gputrace.analyzers.findings.rules import find, framework_of
from gputrace.analyzers.parallel import registry
from gputrace.analyzers.parallel.ddp.findings_replay import _agree, _replay_findings
from gputrace.analyzers.parallel.ddp.replay import Scenario, why_no_replay
from gputrace.analyzers.parallel.findings import findings as par_findings
from gputrace.analyzers.parallel.pp import pp_probed
from gputrace.analyzers.parallel.sharded import zero_whatif
from gputrace.analyzers.run.packed import Packed, Unpacking
from gputrace.analyzers.run.rank_part import (
    FramePart,
    Options,
    RankPart,
    _fsdp_part,
    analyze_frame,
    analyze_source,
    replay_rank,
)
from gputrace.analyzers.run.ranks import (
    _comm_wait,
    _host_bandwidth,
    _link_from_probe,
    _md_world,
    _shared,
)
from gputrace.analyzers.run.reading import _frames, _give_back, parallel_worth_it, release  # noqa: F401
from gputrace.trace.ranked import RankedTrace
from gputrace.window import window_of


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
                   _peaks(probe).get("disk_write"), window_of(md) is not None)
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
    release()
    return combine(parts, md, opts, probe, align, executor,
                   ranked=isinstance(trace, RankedTrace))


def combine(parts: list[FramePart], md: dict[str, Any], opts: Options, probe: Any,
            align: bool = True, executor: Executor | None = None,
            ranked: bool = False) -> Analysis:
    """The analysis of a run from its ranks' parts: the wait for peers in comm (on host
    clocks aligned), each rank's replay and speedup given it (in `executor`'s workers when
    given), its bandwidth (its host's samples) and findings, host clock offsets, outliers;
    and what the parts kept for the sections beside it (Analysis.held; `ranked`: the
    trace was read rank by rank)."""
    ranks = {p.rank: p for fp in parts for p in fp.ranks}
    if not ranks:
        raise NothingToAnalyze("the trace has no spans (no iterations or phases) to analyze")
    hosts = fr.merge_hosts([fp.samples for fp in parts])
    world = max(len(ranks), opts.world, 1)
    clock = estimate(Unpacking(ranks, lambda p: (p.host, p.all_units)), align,
                     {r: p.host for r, p in ranks.items()}) \
        if len({p.host for p in ranks.values()}) > 1 else None
    steps = Unpacking(ranks, lambda p: p.steps)   # one rank's whole at a time
    sels = {r: p.sel for r, p in ranks.items()}
    offsets = {r: clock.offset_ns(p.host) for r, p in ranks.items()} if clock else {}
    waits, arrivals = _comm_wait(steps, sels, offsets) if len(ranks) > 1 else ({}, {})
    rv = registry.RunView(world, opts.link_bytes_per_s, Unpacking(arrivals, Packed.unpack),
                          steps, sels,
                          opts.calibration, offsets, pp_probed.of_metadata(md))
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
            recompute=rcp.seen(p.recompute, md), device_busy=p.device_busy,
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
    kept = held.gather([(fp.rows, fp.present) for fp in parts],
                       {r: p.flops for r, p in ranks.items()},
                       {r: p.run_series for r, p in ranks.items()}, ranked)
    return invariants.check(
        Analysis(out, slowest, world, dict(md), clock=clock, outliers=outliers,
                 slowest_why=told, throughput=tput.job(
                     {r: p.throughput for r, p in ranks.items()}, world, degrees),
                 held=kept),
        opts.what_if, [deg_check] if deg_check else [])


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
