"""Analyzers: pure functions from a loaded trace to frozen results. No I/O, no printing."""

from __future__ import annotations

import ctypes
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from gputrace.analyzers import frame as fr
from gputrace.analyzers.bandwidth import Bandwidth, analyze_bandwidth, bandwidth_series
from gputrace.analyzers.detail import (
    IterationTimeline,
    RankDetail,
    iteration_series,
    iteration_timeline,
    representative,
)
from gputrace.analyzers.findings import Finding, find
from gputrace.analyzers.model import ModelResult, Speedup, build_model, speedup, unit_waits
from gputrace.analyzers.replay import MIB, Replay, Scenario, replay, why_no_replay
from gputrace.analyzers.steps import TERMS, RankSteps, analyze_rank, warmup_skip
from gputrace.trace.reader import RankedTrace


class NothingToAnalyze(Exception):
    """The trace holds no spans (only samples, or nothing)."""


@dataclass(frozen=True)
class Stat:
    mean: float
    std: float


@dataclass(frozen=True)
class RankAnalysis:
    rank: int
    iterations: int
    warmup_skipped: int
    synthetic_iterations: bool
    breakdown: dict[str, Stat]
    comm: dict[str, float]
    io: dict[str, float]
    model: ModelResult
    speedup: Speedup
    bandwidth: Bandwidth | None
    findings: list[Finding]
    comm_wait_s: float | None = None
    comm_transfer_s: float | None = None
    replay: Replay | None = None
    detail: RankDetail | None = None    # per-iteration figures and a timeline, when asked for
    replay_unavailable: str | None = None   # why there is no what-if replay


@dataclass(frozen=True)
class Analysis:
    ranks: dict[int, RankAnalysis]
    slowest_rank: int
    world_size: int
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def main(self) -> RankAnalysis:
        return self.ranks[self.slowest_rank]


def _stat(v: np.ndarray) -> Stat:
    if v.size == 0:
        return Stat(0.0, 0.0)
    return Stat(float(np.mean(v)), float(np.std(v, ddof=1)) if v.size > 1 else 0.0)


def _overlap(h: Any, sel: np.ndarray) -> dict[str, float]:
    tot = float(np.mean(h.total_s[sel])) if sel.size else 0.0
    hid = float(np.mean(h.hidden_s[sel])) if sel.size else 0.0
    exp = float(np.mean(h.exposed_s[sel])) if sel.size else 0.0
    return {"total_s": tot, "hidden_s": hid, "exposed_s": exp,
            "hidden_fraction": hid / tot if tot > 0 else 0.0}


def _comm_wait(steps: dict[int, RankSteps], sels: dict[int, np.ndarray]
               ) -> tuple[dict[int, tuple[float, float]], dict[int, np.ndarray]]:
    """Where several ranks show the same unit of the same step, the transfer can only start
    when the last rank arrives: wait = that moment - own start; transfer = end - that.
    Returns per rank (wait, transfer) seconds per iteration, and the last arrival (ns) of
    each of its unit rows (its own start where no other rank shows the unit)."""
    parts = []
    for r, rs in steps.items():
        u = rs.units
        rows = u.rows(sels[r])
        parts.append((np.full(rows.size, r), rs.iterations.step[u.it[rows]], u.index[rows],
                      u.start[rows], u.end[rows], rows))
    rank, step, index, start, end, row = (np.concatenate(x) for x in zip(*parts, strict=True))
    arrivals = {r: rs.units.start.copy() for r, rs in steps.items()}
    if not rank.size:
        return {}, arrivals
    order = np.lexsort((rank, index, step))
    rank, step, index, start, end, row = (x[order] for x in (rank, step, index, start, end,
                                                             row))
    new = np.r_[True, (step[1:] != step[:-1]) | (index[1:] != index[:-1])]
    group = np.cumsum(new) - 1
    first = np.flatnonzero(new)
    size = np.diff(np.r_[first, rank.size])[group]
    last = np.maximum.reduceat(start, first)[group]   # the last rank to arrive
    shared = size >= 2
    wait = np.where(shared, (last - start) / 1e9, 0.0)
    xfer = np.where(shared, np.maximum(end - last, 0) / 1e9, 0.0)
    out = {}
    for r in steps:
        m = shared & (rank == r)
        if m.any():
            iters = max(len(sels[r]), 1)
            out[r] = (float(wait[m].sum()) / iters, float(xfer[m].sum()) / iters)
            arrivals[r][row[m]] = np.minimum(last[m], end[m])
    return out, arrivals


def _shared(steps: dict[int, RankSteps], devices: dict[int, tuple[int, ...]], md: Any
            ) -> str | None:
    """What the measured ranks shared: one host's cores (ranks computing on the CPU, all on
    one host) or one GPU (ranks whose GPU records name the same device on one host)."""
    if len(steps) < 2:
        return None
    hosts = md.get("hosts") if isinstance(md, dict) else None
    one_host = isinstance(hosts, list) and len(hosts) == 1
    if not one_host:
        return None
    if not any(rs.gpu for rs in steps.values()):
        cpus = md.get("cpus") if isinstance(md.get("cpus"), int) else None
        return (f"the {cpus} CPU cores of host {hosts[0]}" if cpus else
                f"the CPU cores of host {hosts[0]}") + f" ({len(steps)} ranks computing on it)"
    used: dict[int, int] = {}
    for devs in devices.values():
        for d in devs:
            used[d] = used.get(d, 0) + 1
    both = [d for d, n in used.items() if n > 1]
    if both:
        return f"GPU {both[0]} of host {hosts[0]} ({used[both[0]]} ranks on it)"
    return None


def _host_bandwidth(md: Any) -> float | None:
    """The host's own all-reduce bus bandwidth over gloo (`gputrace probe` among local
    processes on the CPU): the least CPU each byte of comm on the CPU costs."""
    probe = md.get("probe") if isinstance(md, dict) else None
    v = ((probe or {}).get("results") or {}).get("allreduce_bus") if isinstance(probe, dict) \
        else None
    if isinstance(v, dict) and v.get("backend") == "gloo" and \
            isinstance(v.get("bytes_per_s"), (int, float)):
        return float(v["bytes_per_s"])
    return None


def _extra_findings(sp: fr.Spans, rs: RankSteps) -> list[Finding]:
    out = []
    memcpy = sp.of("memcpy") | sp.of("h2d")
    pageable = np.flatnonzero(memcpy & sp.kind_is("src", "pageable"))
    if pageable.size:
        b = float(np.nansum(sp.nbytes[pageable]))
        out.append(Finding(
            "h2d_pageable", "moderate",
            f"{len(pageable)} host-to-device copies ({b / 1e6:.1f} MB) come from pageable "
            "memory, which copies slower than pinned: use DataLoader(pin_memory=True)."))
    return out


def _replay_findings(rp: Replay | None, world: int) -> list[Finding]:
    """The bucket size the replay finds fastest at the run's own size, when it saves >= 5%."""
    if rp is None or world < 2:
        return []
    own = [o for o in rp.outcomes if o.scenario.gpus == world and o.scenario.bandwidth_x == 1
           and o.scenario.bucket_bytes is not None]
    if not own:
        return []
    best = min(own, key=lambda o: o.t_iter)
    gain = 1 - best.t_iter / rp.measured_t_iter
    if gain < 0.05:
        return []
    what = "one bucket" if best.scenario.bucket_bytes == float("inf") else \
        f"DDP(bucket_cap_mb={best.scenario.bucket_bytes / MIB:g})"
    return [Finding("what_if_buckets", "moderate",
                    f"Replay: {what} ({best.buckets} units) would take "
                    f"{best.t_iter * 1e3:.1f} ms per iteration instead of "
                    f"{rp.measured_t_iter * 1e3:.1f} ms ({-gain:+.0%}), exposing "
                    f"{best.exposed_s * 1e3:.1f} ms of comm after backward.")]


def _agree(findings: list[Finding], rp: Replay | None, world: int) -> list[Finding]:
    """A finding that recommends a change cites the replay's prediction for it, and does not
    recommend what the replay says would not help."""
    out = []
    for f in findings:
        if f.id == "comm_tail" and rp is not None:
            own = [o for o in rp.outcomes if o.scenario.gpus == max(world, 2)
                   and o.scenario.bandwidth_x == 1 and o.scenario.bucket_bytes is not None]
            best = min(own, key=lambda o: o.t_iter) if own else None
            if best is not None:
                head = f.message.split(": a smaller last bucket")[0]
                if best.t_iter < 0.98 * rp.measured_t_iter:
                    msg = (f"{head}: smaller buckets would shorten it (replay: "
                           f"{best.scenario.label}, {best.t_iter * 1e3:.1f} ms against "
                           f"{rp.measured_t_iter * 1e3:.1f} ms measured).")
                else:
                    msg = (f"{head}; the replay finds no bucket size that shortens the "
                           f"iteration (best: {best.scenario.label}, {best.t_iter * 1e3:.1f} "
                           f"ms against {rp.measured_t_iter * 1e3:.1f} ms measured).")
                f = Finding(f.id, f.severity, msg)
        out.append(f)
    return out


_trim: Any = None     # glibc's malloc_trim, once looked up (False: none here)


def _give_back() -> None:
    """Hand the heap's free pages back to the OS (glibc's malloc_trim; a no-op elsewhere),
    so that one rank's freed arrays do not stay in the process beside the next rank's."""
    global _trim
    if _trim is None:
        try:
            _trim = ctypes.CDLL(None).malloc_trim
        except (OSError, AttributeError):
            _trim = False
    if _trim:
        _trim(0)


def _frames(trace: Any, consume: bool) -> Iterator[fr.Frame]:
    """The trace's frames: one per rank when it can be read rank by rank (RankedTrace),
    else one for the whole table."""
    if isinstance(trace, RankedTrace):
        ranked = any(r >= 0 for r in trace.groups)
        for r in trace.ranks:
            _give_back()
            cols = trace.columns(r, fr.COLUMNS)
            # unranked spans beside ranked ones belong to launchers (torchrun): dropped
            yield fr.build(cols, trace.metadata, drop_unranked=ranked and r < 0)
            del cols
    elif consume:
        cols = {c: trace.table.column(c) for c in trace.table.column_names}
        trace.table = None
        yield fr.build(cols, trace.metadata)
    else:
        yield fr.build(trace.table, trace.metadata)


def analyze(trace: Any, *, skip: int | None = None, gpus: Sequence[int] = (2, 4, 8, 16),
            link_bytes_per_s: float | None = None, shared_io: bool = False,
            what_if: Sequence[Scenario] = (), consume: bool = False,
            detail: bool = False, host_bytes_per_s: float | None = None) -> Analysis:
    """Analyze a loaded trace (gputrace.trace.Trace, or a RankedTrace read one rank at a
    time); `what_if` adds replay scenarios; `host_bytes_per_s`: the host's own gloo
    all-reduce bus bandwidth (default: the probe's, when it ran gloo), the least CPU a byte of
    comm on the CPU costs. `consume` hands a Trace's table over
    (trace.table becomes None), so its columns are freed one by one as they are converted:
    the command line's peak memory. `detail` keeps, per rank, what a report draws
    (RankAnalysis.detail): per-iteration figures, the timeline of a median iteration and
    bandwidth over time."""
    steps: dict[int, RankSteps] = {}
    extra: dict[int, list[Finding]] = {}
    devices: dict[int, tuple[int, ...]] = {}      # the GPUs each rank's records name
    parts: list[dict[str, fr.Samples]] = []
    sels: dict[int, np.ndarray] = {}
    skipped: dict[int, int] = {}
    timelines: dict[int, IterationTimeline | None] = {}
    for f in _frames(trace, consume):
        for r in list(f.ranks):
            sp = f.ranks.pop(r)     # each rank's spans are freed once it is summarized
            rs = steps[r] = analyze_rank(sp)
            extra[r] = _extra_findings(sp, rs)
            devices[r] = tuple(int(d) for d in np.unique(sp.device[sp.on_gpu()]))
            n = rs.iterations.start.size
            skipped[r] = warmup_skip(n, skip)
            sels[r] = np.arange(skipped[r], n)
            if detail:
                timelines[r] = iteration_timeline(sp, rs, representative(rs, sels[r])) \
                    if n else None
            del sp
        parts.append(f.samples)
    if not steps:
        raise NothingToAnalyze("the trace has no spans (no iterations or phases) to analyze")
    samples = fr.merge_samples(parts)
    probe = trace.metadata.get("probe") if isinstance(trace.metadata, dict) else None
    if link_bytes_per_s is None and isinstance(probe, dict):
        for key in ("allreduce_bus", "ib", "p2p"):
            v = (probe.get("results") or {}).get(key)
            if isinstance(v, dict) and isinstance(v.get("bytes_per_s"), (int, float)):
                link_bytes_per_s = float(v["bytes_per_s"])
                break
    world = max(len(steps), int(trace.metadata.get("world_size") or 0)
                if isinstance(trace.metadata.get("world_size"), int) else 0, 1)
    waits, arrivals = _comm_wait(steps, sels) if len(steps) > 1 else ({}, {})
    host = _host_bandwidth(trace.metadata)
    shared = _shared(steps, devices, trace.metadata)
    out: dict[int, RankAnalysis] = {}
    for r, rs in steps.items():
        sel = sels[r]
        model = build_model(rs, sel)
        rp = replay(rs, sel, model, world, gpus, link_bytes_per_s, what_if, intervals=False,
                    arrivals=arrivals.get(r), host_bytes_per_s=host_bytes_per_s or host)
        sp_ = speedup(model, world, gpus, link_bytes_per_s, shared_io,
                      float(sum(rs.layer_bytes.values())),
                      contention_s=rp.contention_s if rp is not None else 0.0,
                      shared=shared, unit_waits=unit_waits(rs, sel, arrivals.get(r)))
        comm = _overlap(rs.comm, sel)
        io = _overlap(rs.io, sel)
        bw = None
        if samples and sel.size:
            lo = int(rs.iterations.start[sel[0]])
            hi = int(rs.iterations.end[sel[-1]])
            bw = analyze_bandwidth(samples, lo, hi, int(sel.size),
                                   io["total_s"] * sel.size, probe)
        more = {"findings": extra[r] + _replay_findings(rp, world)}
        rd = None
        if detail:
            lo, hi = int(rs.iterations.start[0]), int(rs.iterations.end[-1])
            rd = RankDetail(iteration_series(rs, skipped[r]), timelines[r],
                            bandwidth_series(samples, lo, hi, probe) if samples else [], lo)
        w = waits.get(r)
        out[r] = RankAnalysis(
            rank=r, iterations=int(rs.iterations.start.size), warmup_skipped=skipped[r],
            synthetic_iterations=rs.iterations.synthetic,
            breakdown={k: _stat(rs.terms[k][sel]) for k in TERMS},
            comm=comm, io=io, model=model, speedup=sp_, bandwidth=bw,
            findings=_agree(find(model, comm, io, bw, more), rp, world),
            comm_wait_s=w[0] if w else None, comm_transfer_s=w[1] if w else None,
            replay=rp, detail=rd,
            replay_unavailable=None if rp is not None else why_no_replay(
                rs, sel, world, link_bytes_per_s))
    slowest = max(out, key=lambda r: out[r].breakdown["t_iter"].mean)
    main = out[slowest]
    if main.replay is not None:
        # the shown rank's predictions get their intervals (iterations resampled)
        out[slowest] = replace(main, replay=replay(
            steps[slowest], sels[slowest], main.model, world, gpus, link_bytes_per_s, what_if,
            arrivals=arrivals.get(slowest), host_bytes_per_s=host_bytes_per_s or host))
    return Analysis(out, slowest, world, dict(trace.metadata))
