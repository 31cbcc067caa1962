"""Per-iteration figures and one iteration's timeline, for reports that draw them.

Everything here is a summary whose size grows with iterations, ranks, layers, comm units and
GPU streams, never with the number of events: the GPU records of an iteration are merged per
stream and phase into at most `MAX_BARS` bars.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from gputrace.analyzers.core import overlap as ov
from gputrace.analyzers.core.bandwidth import LinkSeries
from gputrace.analyzers.core.frame import Spans
from gputrace.analyzers.core.layer_names import label, modules_of_spans
from gputrace.analyzers.core.steps import RankSteps

HOST_PHASES = ("io", "h2d", "forward", "backward", "update")
MAX_BARS = 300          # per lane and colour, after merging
MAX_LANES = 32          # per kind (layers, units): more are packed into shared lanes


@dataclass(frozen=True)
class IterationSeries:
    """Every iteration of one rank, in order."""

    step: np.ndarray                 # the iteration's step number (-1 unknown)
    start_ns: np.ndarray
    end_ns: np.ndarray
    terms: dict[str, np.ndarray]     # steps.TERMS, seconds per iteration
    comm_exposed_s: np.ndarray       # comm not hidden under compute, per iteration
    warmup: int                      # the first `warmup` iterations are left out of means
    left_out: int | None = None      # an analyzed one left out too (its FLOPs were counted)

    @property
    def kept(self) -> np.ndarray:
        """The indices of the iterations the means are made of."""
        k = np.arange(self.warmup, self.start_ns.size)
        return k if self.left_out is None else k[k != self.left_out]


def iteration_series(rs: RankSteps, warmup: int, left_out: int | None = None
                     ) -> IterationSeries:
    its = rs.iterations
    return IterationSeries(its.step, its.start, its.end, rs.terms, rs.comm.exposed_s, warmup,
                           left_out)


@dataclass(frozen=True)
class Bar:
    """One bar of a timeline, in seconds from the iteration's start."""

    lane: str
    what: str          # a phase, "comm hidden" / "comm exposed" for units, or a GPU category
    start_s: float
    end_s: float
    count: int = 1     # records merged into this bar
    part: str = ""     # units: "queued" (ready -> start) or "on the link" (start -> end)
    note: str = ""


@dataclass(frozen=True)
class IterationTimeline:
    index: int          # into the rank's iterations
    step: int
    start_ns: int
    t_iter_s: float
    lanes: list[str]    # top to bottom
    bars: list[Bar]


def representative(rs: RankSteps, sel: np.ndarray) -> int:
    """The analyzed iteration whose length is the median (the earlier of two)."""
    pool = sel if sel.size else np.arange(rs.iterations.start.size)
    t = rs.terms["t_iter"][pool]
    return int(pool[np.argsort(t, kind="stable")[(t.size - 1) // 2]])


def _merged(start: np.ndarray, end: np.ndarray, window_ns: int, most: int = MAX_BARS
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Intervals merged across gaps narrower than a pixel of a wide chart (window / 2000),
    the gap doubled until at most `most` remain: (starts, ends, records in each)."""
    order = np.argsort(start, kind="stable")
    start, end = start[order], end[order]
    gap = max(window_ns // 2000, 1)
    while True:
        s, e = ov.union(start, end + gap)
        if s.size <= most:
            break
        gap *= 2
    e = np.maximum(e - gap, s)
    count = np.searchsorted(start, e, "right") - np.searchsorted(start, s, "left")
    return s, e, np.maximum(count, 1)


def _layers(layers: tuple[int, ...] | None) -> str:
    if not layers:
        return "layers unknown"
    return f"layer {layers[0]}" if len(layers) == 1 else f"layers {min(layers)}-{max(layers)}"


def iteration_timeline(sp: Spans, rs: RankSteps, k: int) -> IterationTimeline:
    """Iteration k of one rank: host phases on the training loop, per-layer forward and
    backward, each comm unit from ready to end (hidden or exposed), loader work, and GPU
    records per device and stream, merged per phase."""
    lo = int(rs.iterations.start[k])
    hi = int(rs.iterations.end[k])
    u = rs.units
    rows = np.arange(int(u.cuts[k]), int(u.cuts[k + 1]))
    stop = max(hi, int(u.end[rows].max()) if rows.size else hi)   # comm may outlast it
    window = max(stop - lo, 1)
    sec = 1e9
    bars: list[Bar] = []
    lanes: list[str] = []

    def rel(x: np.ndarray) -> np.ndarray:
        return (np.clip(x, lo, stop) - lo) / sec

    def spans(lane: str, m: np.ndarray) -> None:
        for i in np.flatnonzero(m):
            a, b = rel(np.array([sp.start[i], sp.end[i]])).tolist()
            bars.append(Bar(lane, sp.cats[sp.cat[i]], a, b))

    near = (sp.end > lo) & (sp.start < stop)
    pid, tid = rs.iterations.loop
    on_loop = (sp.pid == pid) & (sp.tid == tid)
    host = near & (sp.device < 0)
    outer = np.zeros(sp.start.size, dtype=bool)
    for ph in HOST_PHASES:
        outer |= sp.of(ph)
    loop_m = host & on_loop & outer & (sp.layer < 1)
    if loop_m.any():
        lanes.append("host")
        spans("host", loop_m)
    # each layer's forward, backward and recompute (activation checkpointing's forward run
    # again inside the backward)
    per_layer = host & (sp.of("forward") | sp.of("backward") | sp.of("recompute")) & \
        (sp.layer >= 1)
    layers = sorted(set(sp.layer[per_layer].tolist()), reverse=True)
    first = len(bars)
    modules = modules_of_spans(sp) if layers else {}
    for ly in layers:
        mine = per_layer & (sp.layer == ly)
        # named by its module path and class, as `diff` names it (a span named only by its
        # phase, as some imports name them: its number alone)
        cls = sp.names[sp.name[np.flatnonzero(mine)[0]]]
        lane = f"layer {ly}" if cls in ("forward", "backward", "recompute", "layer") and \
            ly not in modules else f"layer {label(ly, cls, modules.get(ly))}"
        lanes.append(lane)
        spans(lane, mine & ~sp.of("recompute"))
        spans(lane, mine & sp.of("recompute"))  # on top
    if len(layers) > MAX_LANES:
        del lanes[-len(layers):]
        lanes += _pack(bars, first, "layers")
    first = len(bars)
    for row in rows:
        lane = f"unit {int(u.index[row])}"
        lanes.append(lane)
        what = "comm hidden" if u.hidden[row] else "comm exposed"
        nb = u.nbytes[row]
        note = _layers(u.layers(int(row))) + ("" if np.isnan(nb) else f", {nb / 1e6:.2f} MB")
        r, s, e = rel(np.array([u.ready[row], u.start[row], u.end[row]])).tolist()
        if s > r:
            bars.append(Bar(lane, what, r, s, part="queued", note=note))
        bars.append(Bar(lane, what, s, e, part="on the link", note=note))
    if rows.size > MAX_LANES:
        del lanes[-rows.size:]
        lanes += _pack(bars, first, "units")
    loader = host & sp.of("io") & ~on_loop
    for p in sorted(set(sp.pid[loader].tolist())):
        m = loader & (sp.pid == p)
        lane = f"loader {p}"
        lanes.append(lane)
        bars += _summary(lane, "io", sp.start[m], sp.end[m], window, rel)
    gpu = near & sp.on_gpu()
    if gpu.any():
        stream = sp.stream if sp.stream is not None else np.full(sp.start.size, -1)
        idx = np.flatnonzero(gpu)
        phase_of = np.array(sp.phases + ["", ""])[sp.phase[idx]]   # code -1 -> ""
        to_dev = (sp.kind_is("src", "pageable") | sp.kind_is("src", "pinned")) & \
            sp.kind_is("dst", "device") & sp.of("memcpy")       # as steps counts t_h2d
        cat = np.where(to_dev[idx], "h2d", np.array(sp.cats)[sp.cat[idx]])
        what = np.where(sp.of("comm")[idx], "comm", np.where(phase_of != "", phase_of, cat))
        for d, st in sorted(set(zip(sp.device[idx].tolist(), stream[idx].tolist(),
                                    strict=True))):
            lane = f"GPU {d}" + (f" stream {st}" if st >= 0 else "")
            lanes.append(lane)
            here = (sp.device[idx] == d) & (stream[idx] == st)
            for w in sorted(set(what[here].tolist())):
                j = idx[here & (what == w)]
                bars += _summary(lane, w, sp.start[j], sp.end[j], window, rel)
    return IterationTimeline(k, int(rs.iterations.step[k]), lo, (hi - lo) / sec, lanes, bars)


def _pack(bars: list[Bar], first: int, name: str) -> list[str]:
    """Put the bars from `first` on as few shared lanes as keep them apart (each lane's
    bars one after another; the bars of one former lane stay together), in place; the
    former lane goes into the note. Returns the new lanes."""
    groups: dict[str, list[Bar]] = {}
    for b in bars[first:]:
        groups.setdefault(b.lane, []).append(b)
    ends: list[float] = []
    out: list[Bar] = []
    whole = name == "units"    # a unit's queued and on-the-link parts share a lane
    items = list(groups.values()) if whole else [[b] for g in groups.values() for b in g]
    for g in sorted(items, key=lambda g: min(b.start_s for b in g)):
        a, z = min(b.start_s for b in g), max(b.end_s for b in g)
        j = next((j for j, e in enumerate(ends) if e <= a), len(ends))
        if j == len(ends):
            ends.append(z)
        ends[j] = z
        out += [replace(b, lane=f"{name} ({j + 1})",
                        note=b.lane + (f", {b.note}" if b.note else "")) for b in g]
    bars[first:] = out
    return [f"{name} ({j + 1})" for j in range(len(ends))]


def _summary(lane: str, what: str, start: np.ndarray, end: np.ndarray, window: int,
             rel: Callable[[np.ndarray], np.ndarray]) -> list[Bar]:
    s, e, n = _merged(start, end, window)
    return [Bar(lane, what, a, b, c) for a, b, c in
            zip(rel(s).tolist(), rel(e).tolist(), n.tolist(), strict=True)]


@dataclass(frozen=True)
class RankDetail:
    """What a report draws for one rank beyond the means."""

    series: IterationSeries
    timeline: IterationTimeline | None
    bandwidth: list[LinkSeries] = field(default_factory=list)
    bandwidth_start_ns: int = 0     # where the bandwidth series' time axis starts
    # per comm unit index, its duration (s) in each analyzed iteration that has it: the
    # figures whose mean is the unit's duration_s (for `diff`'s intervals)
    unit_durations: dict[int, np.ndarray] = field(default_factory=dict)


def unit_durations(rs: RankSteps, sel: np.ndarray) -> dict[int, np.ndarray]:
    """Each comm unit's duration in each of the iterations `sel` that has it, in seconds."""
    u = rs.units
    rows = u.rows(sel)
    dur = (u.end[rows] - u.start[rows]) / 1e9
    idx = u.index[rows]
    return {int(k): dur[idx == k] for k in np.unique(idx)}
