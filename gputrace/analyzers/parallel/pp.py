"""Pipeline parallelism: each rank's stage (its microbatches' forward and backward, the time
in each schedule step it computed nothing: the bubble, its waits for its neighbours
included), and, across the ranks, the pipeline: stages, schedule, microbatches, the bubble
beside the schedule's theoretical (p-1)/(m+p-1), the slowest stage, and what-ifs replayed on
the measured per-microbatch times (pipesim): more or fewer microbatches, the other schedule,
layers moved between stages to balance them."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from gputrace.analyzers.collectives import Rows
from gputrace.analyzers.frame import Spans
from gputrace.analyzers.parallel import pipesim
from gputrace.analyzers.parallel.pp_whatif import (
    ASSUMPTIONS,
    Calibration,
    Compute,
    WhatIf,
    predict,  # noqa: F401 - the what-ifs' replay
)
from gputrace.analyzers.parallel.pp_whatif import calibrated as _calibrated
from gputrace.analyzers.parallel.rows import rows_in


@dataclass(frozen=True)
class Stage:
    """One rank's stage, means over the analyzed iterations."""

    rank: int
    stage: int
    schedule: str
    microbatches: int
    num_stages: int
    forward_s: float      # per microbatch
    backward_s: float     # per microbatch (and its weight part, zero-bubble schedules)
    loss_s: float         # per microbatch (last stage)
    step_s: float         # the schedule's step
    bubble_s: float       # per iteration (t_pp): the step's time it computed nothing
    waits_s: float        # its waits for its neighbours (p2p), per iteration
    p2p_count: float      # sends and receives, per iteration
    p2p_bytes: float
    t_iter: float
    layers: dict[int, float] = field(default_factory=dict)   # layer -> backward s per mb
    # the pipeline spans of a few analyzed iterations (BLOCK_STEPS, the middle ones), as
    # recorded (trace ns): (step, name, microbatch, start, end); the step itself has mb -1
    blocks: tuple[tuple[int, str, int, int, int], ...] = ()

    @property
    def busy_s(self) -> float:
        return self.microbatches * (self.forward_s + self.backward_s + self.loss_s)


BLOCK_STEPS = 9      # iterations whose pipeline spans a stage keeps (a report draws one)


def _args(sp: Spans, idx: np.ndarray) -> list[dict[str, Any]]:
    out = []
    for a in sp.args.take(pa.array(idx)).to_pylist():
        try:
            v = json.loads(a) if a else {}
        except ValueError:
            v = {}
        out.append(v if isinstance(v, dict) else {})
    return out


def analyze(sp: Spans, r: Rows, it_start: np.ndarray, it_end: np.ndarray, sel: np.ndarray,
            terms: dict[str, np.ndarray], md: dict[str, Any] | None = None) -> Stage | None:
    """The rank's stage over the analyzed iterations, or None without pipeline spans."""
    pipe = np.flatnonzero(sp.of("pipeline"))
    if not pipe.size or not sel.size:
        return None
    it = np.searchsorted(it_start, sp.start[pipe], side="right") - 1
    keep = (it >= 0) & np.isin(it, sel)
    pipe = pipe[keep]
    if not pipe.size:
        return None
    names = [sp.names[c] for c in sp.name[pipe].tolist()]
    args = _args(sp, pipe)
    dur = (sp.end[pipe] - sp.start[pipe]) / 1e9
    steps = [a for n, a in zip(names, args, strict=True) if n == "step"]
    if not steps:
        return None
    head = steps[-1]
    n_it = float(sel.size)

    def per_mb(name: str) -> float:
        """Per microbatch, the stage's compute in its `name` chunks: the module's forward,
        the backward's autograd (their host spans inside the chunks; not the schedule's
        own work around them)."""
        m = np.array([n == name for n in names], bool)
        if not m.any():
            return 0.0
        cat = "forward" if name == "forward" else "backward"
        inner = np.flatnonzero(sp.of(cat) & (sp.layer < 1) & (sp.device < 0)
                               & (sp.name != (sp.names.index("loss") if "loss" in sp.names
                                              else -2)))
        lo, hi = sp.start[pipe[m]], sp.end[pipe[m]]
        k = np.searchsorted(lo, sp.start[inner], side="right") - 1
        ok = k >= 0
        ok[ok] &= sp.end[inner[ok]] <= hi[k[ok]]
        return float((sp.end[inner[ok]] - sp.start[inner[ok]]).sum() / 1e9 / m.sum())

    step_s = float(dur[np.array([n == "step" for n in names], bool)].sum()) / n_it
    stage = int((head.get("stages") or [-1])[0])
    md = md or {}
    p = int(head.get("num_stages") or md.get("num_stages") or 0) or _stages_from(sp, r)
    loss = _loss_s(sp, it_start, sel)
    j, _ = rows_in(sp, r, "pp", it_start, it_end, sel)
    # the sends and receives (a DeepSpeed pipeline's step also has collectives on the
    # pipeline group: its loss broadcast, its gradient norm's all-reduce)
    j = j[np.array([r.kind[x] == "send_recv" for x in j.tolist()], bool)]
    waits = np.where(r.wait_s[j] >= 0, r.wait_e[j] - r.wait_s[j], 0) / 1e9
    # a batch_isend_irecv is one record of several sends and receives (args.ops)
    ops = sum(_int(a.get("ops"), 1) for a in _args(sp, r.idx[j]))
    return Stage(sp.rank, stage, str(head.get("schedule", "")),
                 int(head.get("microbatches", 0)), p, per_mb("forward"),
                 per_mb("backward") + per_mb("backward_weight"), loss, step_s,
                 float(np.mean(terms["t_pp"][sel])) if "t_pp" in terms else 0.0,
                 float(waits.sum()) / n_it, float(ops) / n_it,
                 float(np.nansum(r.nbytes[j])) / n_it, float(np.mean(terms["t_iter"][sel])),
                 _layer_backward(sp, it_start, sel), _blocks(sp, pipe, names, args))


def _blocks(sp: Spans, pipe: np.ndarray, names: list[str], args: list[dict[str, Any]]
            ) -> tuple[tuple[int, str, int, int, int], ...]:
    """The pipeline spans of the middle BLOCK_STEPS analyzed iterations (by their step: the
    same ones on every rank of a lock-stepped pipeline)."""
    steps = np.unique(sp.step[pipe])
    steps = steps[steps >= 0]
    if not steps.size:
        return ()
    mid = steps.size // 2
    keep = set(steps[max(mid - BLOCK_STEPS // 2, 0):mid + BLOCK_STEPS // 2 + 1].tolist())
    out = []
    for i, n, a in zip(pipe.tolist(), names, args, strict=True):
        st = int(sp.step[i])
        if st in keep:
            mb = a.get("mb", -1) if n != "step" else -1
            out.append((st, n, int(mb) if isinstance(mb, int) else -1, int(sp.start[i]),
                        int(sp.end[i])))
    return tuple(sorted(out, key=lambda b: (b[0], b[3])))


def _ran(s: Stage) -> list[tuple[str, int]]:
    """The stage's forward and backward microbatches in the order it ran them, in every
    step of its kept blocks alike ([] when steps differ or none was kept)."""
    per: dict[int, list[tuple[str, int]]] = {}
    for step, name, mb, _, _ in s.blocks:
        if name in ("forward", "backward"):
            per.setdefault(step, []).append((name[0].upper(), mb))
    orders = list(per.values())
    return orders[0] if orders and all(o == orders[0] for o in orders) else []


def _int(v: Any, default: int) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else default


def _stages_from(sp: Spans, r: Rows) -> int:
    sizes = r.group_size[np.array([d == "pp" for d in r.dim], bool)]
    return int(sizes.max()) if sizes.size and sizes.max() > 0 else 0


def _loss_s(sp: Spans, it_start: np.ndarray, sel: np.ndarray) -> float:
    """Mean duration of the schedule's loss spans (the last stage's), per microbatch."""
    if "loss" not in sp.names:
        return 0.0
    m = np.flatnonzero(sp.of("forward") & (sp.name == sp.names.index("loss")))
    it = np.searchsorted(it_start, sp.start[m], side="right") - 1
    m = m[(it >= 0) & np.isin(it, sel)]
    return float(((sp.end[m] - sp.start[m]) / 1e9).mean()) if m.size else 0.0


def _layer_backward(sp: Spans, it_start: np.ndarray, sel: np.ndarray) -> dict[int, float]:
    """Per layer of the stage, its backward seconds per microbatch (what balancing moves)."""
    m = np.flatnonzero(sp.of("backward") & (sp.layer >= 1) & (sp.device < 0))
    it = np.searchsorted(it_start, sp.start[m], side="right") - 1
    m = m[(it >= 0) & np.isin(it, sel)]
    out: dict[int, list[float]] = {}
    for ly, d in zip(sp.layer[m].tolist(), ((sp.end[m] - sp.start[m]) / 1e9).tolist(),
                     strict=True):
        out.setdefault(int(ly), []).append(d)
    return {k: float(np.mean(v)) for k, v in sorted(out.items())}


@dataclass(frozen=True)
class Pipeline:
    """The pipeline across its ranks."""

    stages: list[Stage]
    schedule: str
    microbatches: int
    num_stages: int
    bubble: float         # mean over stages: bubble / iteration
    theory: float         # (p-1)/(m+p-1), a share of the schedule's step
    slowest: int          # stage index
    transfer_s: float     # fitted (pipesim.fit_transfer)
    replayed_step_s: float
    what_if: list[WhatIf] = field(default_factory=list)
    assumptions: tuple[str, ...] = ASSUMPTIONS
    bubble_step: float = 0.0   # mean over stages: bubble / the schedule's step (as theory)
    # per stage, its replicas averaged: forward and backward per microbatch; the last
    # stage's loss; the first stage's iteration outside its step
    per_stage: tuple[tuple[float, ...], tuple[float, ...], float, float] = ((), (), 0.0, 0.0)
    compute: Compute = Compute((), (), (0.0, 0.0))   # per microbatch as m changes (what-ifs)
    calibration_note: str = ""   # why a calibrating run given was not used
    recorded_schedule: str = ""  # the recorded schedule replayed as `schedule` (its order)

    def headline(self) -> str:
        name = pipesim.SHORT.get(self.schedule, self.schedule)
        if self.recorded_schedule:
            name = f"{self.recorded_schedule}, {name} order"
        return (f"pipeline, {self.num_stages} stages x {self.microbatches} microbatches "
                f"({name}): bubble "
                f"{self.bubble_step:.0%} of the schedule's step ({self.bubble:.0%} of the "
                f"iteration), theory {self.theory:.0%}")


def combine(stages: list[Stage], extra: list[int] | None = None,
            calibration: Calibration | None = None) -> Pipeline | None:
    """The pipeline of the ranks' stages (one stage per rank), with its what-ifs: the
    microbatch counts in `extra` (default: half and double the measured), the other
    schedule, and the layers rebalanced; `calibration`: another run of it at another
    microbatch count, to fit each stage's compute per microbatch (pp_whatif)."""
    st = sorted((s for s in stages if s.stage >= 0), key=lambda s: (s.stage, s.rank))
    if not st:
        return None
    # several ranks per stage (pipeline x data parallel: a pipeline per replica): a stage's
    # times are its replicas' mean
    by: dict[int, list[Stage]] = {}
    for s in st:
        by.setdefault(s.stage, []).append(s)
    p = max(st[0].num_stages, len(by))
    if sorted(by) != list(range(p)):
        return None   # not every stage was recorded: no replay

    def mean(stage: int, f: Any) -> float:
        return float(np.mean([f(x) for x in by[stage]]))

    m, sched = st[0].microbatches, st[0].schedule
    recorded = ""
    if sched not in pipesim.SCHEDULES:
        # a schedule of another library (DeepSpeed's TrainSchedule) replays as the known one
        # whose order every stage ran
        ran = [_ran(by[k][0]) for k in range(p)]
        same = [s for s in pipesim.SCHEDULES
                if all(o and o == pipesim.order(s, k, p, m) for k, o in enumerate(ran))]
        if same:
            recorded, sched = sched, same[0]
    fwd = [mean(k, lambda x: x.forward_s) for k in range(p)]
    bwd = [mean(k, lambda x: x.backward_s) for k in range(p)]
    loss = mean(p - 1, lambda x: x.loss_s)
    # the pipeline's makespan is the first stage's step: it starts the first forward and
    # (GPipe, 1F1B) ends the last backward; a later stage's step also holds its wait for
    # the first stage to start (ranks that left the previous iteration early)
    step = mean(0, lambda x: x.step_s)
    known = sched in pipesim.SCHEDULES
    transfer = pipesim.fit_transfer(sched, fwd, bwd, m, loss, step) if known else 0.0
    base = pipesim.replay(sched, fwd, bwd, m, transfer, loss).makespan if known else step
    outside = mean(0, lambda x: x.t_iter - x.step_s)
    slowest = max(range(p), key=lambda k: mean(k, lambda x: x.busy_s))
    out = Pipeline(st, sched, m, p, float(np.mean([s.bubble_s / s.t_iter for s in st
                                                   if s.t_iter > 0])),
                   pipesim.theory(p, m), slowest, transfer, base,
                   bubble_step=float(np.mean([min(s.bubble_s / s.step_s, 1.0) for s in st
                                              if s.step_s > 0])),
                   per_stage=(tuple(fwd), tuple(bwd), loss, outside),
                   recorded_schedule=recorded)
    if not known:
        return out
    return _calibrated(out, calibration, [by[k][0] for k in range(p)], extra)


def as_dict(pl: Pipeline) -> dict[str, Any]:
    """`--json`'s pipeline section."""
    return {"schedule": pl.schedule, "recorded_schedule": pl.recorded_schedule or pl.schedule,
            "microbatches": pl.microbatches,
            "num_stages": pl.num_stages, "bubble": pl.bubble, "bubble_step": pl.bubble_step,
            "theory": pl.theory,
            "slowest_stage": pl.slowest, "transfer_s": pl.transfer_s,
            "replayed_step_s": pl.replayed_step_s,
            "stages": [{k: v for k, v in vars(s).items()
                        if k not in ("layers", "blocks")} | {
                "busy_s": s.busy_s} for s in pl.stages],
            "what_if": [vars(w) for w in pl.what_if], "assumptions": list(pl.assumptions),
            "compute": pl.compute.as_dict() | (
                {"calibration_unused": pl.calibration_note} if pl.calibration_note else {}),
            "headline": pl.headline()}


@dataclass(frozen=True)
class Block:
    """A microbatch's forward or backward on a stage (or the stage's schedule step, name
    "step", mb -1), in seconds from the iteration's first step start."""

    stage: int
    rank: int
    name: str
    mb: int
    start_s: float
    end_s: float


@dataclass(frozen=True)
class Iteration:
    """One iteration of the pipeline as it ran: every stage's blocks on one clock."""

    step: int
    blocks: list[Block]
    makespan_s: float           # the first stage's step start to the last step's end

    @property
    def idle(self) -> dict[int, float]:
        """Per stage, the share of the makespan it computed nothing (its bubble: the gaps
        between its blocks, before its first and after its last)."""
        busy: dict[int, float] = {}
        for b in self.blocks:
            busy.setdefault(b.stage, 0.0)
            if b.name != "step":
                busy[b.stage] += b.end_s - b.start_s
        return {s: 1 - v / self.makespan_s if self.makespan_s > 0 else 0.0
                for s, v in sorted(busy.items())}


def first_replica(pl: Pipeline) -> list[Stage]:
    """One pipeline: each stage's lowest rank (pipeline x data parallel runs a pipeline per
    replica)."""
    out: dict[int, Stage] = {}
    for s in pl.stages:
        out.setdefault(s.stage, s)
    return [out[k] for k in sorted(out)]


def iteration(pl: Pipeline, offsets: dict[int, int] | None = None) -> Iteration | None:
    """A representative iteration: of those every stage kept (Stage.blocks), the one whose
    first stage's step is the median; times from the first stage's step start (where the
    pipeline starts; a later stage's step, begun earlier to wait for it, is cut there), on
    one clock by subtracting each rank's host offset (`offsets`, ns, as Analysis.clock gives
    them). None when no iteration was kept by every stage."""
    offsets = offsets or {}
    stages = first_replica(pl)
    common: set[int] | None = None
    for s in stages:
        mine = {b[0] for b in s.blocks if b[1] == "step"}
        common = mine if common is None else common & mine
    if not common:
        return None
    first = {b[0]: b for b in stages[0].blocks if b[1] == "step"}
    ranked = sorted(common, key=lambda k: (first[k][4] - first[k][3], k))
    step = ranked[(len(ranked) - 1) // 2]
    t0 = first[step][3] - offsets.get(stages[0].rank, 0)
    blocks = []
    for s in stages:
        off = offsets.get(s.rank, 0) + t0
        for b in s.blocks:
            if b[0] == step and b[4] - off > 0:
                blocks.append(Block(s.stage, s.rank, b[1], b[2], max(b[3] - off, 0) / 1e9,
                                    (b[4] - off) / 1e9))
    return Iteration(step, blocks, max(b.end_s for b in blocks))
