"""Pipeline parallelism: each rank's stage (its microbatches' forward and backward, the time
in each schedule step it computed nothing: the bubble, its waits for its neighbours
included), and, across the ranks, the pipeline: stages, schedule, microbatches, the bubble
beside the schedule's theoretical (p-1)/(m+p-1), the slowest stage, and what-ifs replayed on
the measured per-microbatch times (pipesim): more or fewer microbatches, the other schedule,
layers moved between stages to balance them."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pyarrow as pa

from gputrace.analyzers.core.collectives import Rows
from gputrace.analyzers.core.frame import Spans
from gputrace.analyzers.parallel.pp import pipesim, pp_fit, pp_probed, pporders
from gputrace.analyzers.parallel.pp.pp_model import (  # noqa: F401 - the pipeline's records
    BLOCK_STEPS,
    Calibration,
    Compute,
    Pipeline,
    Stage,
    WhatIf,
)
from gputrace.analyzers.parallel.pp.pp_timeline import (  # noqa: F401 - the report's
    Block,
    Iteration,
    first_replica,
    first_replica_of,
    iteration,
)
from gputrace.analyzers.parallel.pp.pp_whatif import calibrated as _calibrated
from gputrace.analyzers.parallel.pp.pp_whatif import predict  # noqa: F401 - the what-ifs' replay
from gputrace.analyzers.parallel.rows import rows_in


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

    def of(name: str, stage: int | None) -> np.ndarray:
        return np.array([n == name and (stage is None or a.get("stage") == stage)
                         for n, a in zip(names, args, strict=True)], bool)

    def chunk(name: str, stage: int) -> float:
        """Per microbatch, the stage's `name` chunks (the schedule's own work in them
        included)."""
        m = of(name, stage)
        return float(dur[m].sum() / m.sum()) if m.any() else 0.0

    def per_mb(name: str, stage: int | None = None) -> float:
        """Per microbatch, the stage's compute in its `name` chunks (those of `stage`, or
        of every stage held): the module's forward, the backward's autograd (their host
        spans inside the chunks; not the schedule's own work around them)."""
        m = of(name, stage)
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
        # a chunk with no such span inside (a zero-bubble schedule's backward parts run
        # autograd.grad on the stage's graph, no backward call): the chunk itself
        has = np.bincount(k[ok], minlength=lo.size) > 0
        bare = float((hi[~has] - lo[~has]).sum())
        return float(((sp.end[inner[ok]] - sp.start[inner[ok]]).sum() + bare) / 1e9
                     / m.sum())

    held = sorted({int(x) for x in head.get("stages") or [] if isinstance(x, int)})
    by_stage = {}
    for k in held:
        w = per_mb("backward_weight", k)
        by_stage[k] = (per_mb("forward", k), per_mb("backward", k) + w, w)

    step_s = float(dur[np.array([n == "step" for n in names], bool)].sum()) / n_it
    bubble_s = float(np.mean(terms["t_pp"][sel])) if "t_pp" in terms else 0.0
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
    # the schedule's own work between the chunks (its bubble less its waits), per chunk
    n_chunks = sum(n in ("forward", "backward", "backward_weight") for n in names) / n_it
    between = max(bubble_s - float(waits.sum()) / n_it, 0.0) / n_chunks if n_chunks else 0.0
    own = {k: (max(chunk("forward", k) - f, 0.0) + between,
               max(chunk("backward", k) + chunk("backward_weight", k) - b, 0.0)
               + between * (2 if w > 0 else 1)) for k, (f, b, w) in by_stage.items()}
    fwd = sum(f for f, _, _ in by_stage.values()) if held else per_mb("forward")
    bwd = sum(b for _, b, _ in by_stage.values()) if held else \
        per_mb("backward") + per_mb("backward_weight")
    return Stage(sp.rank, stage, str(head.get("schedule", "")),
                 int(head.get("microbatches", 0)), p, fwd, bwd, loss, step_s, bubble_s,
                 float(waits.sum()) / n_it, float(ops) / n_it,
                 float(np.nansum(r.nbytes[j])) / n_it, float(np.mean(terms["t_iter"][sel])),
                 _layer_backward(sp, it_start, sel), _blocks(sp, pipe, names, args, stage),
                 tuple(held), by_stage, own)


def _blocks(sp: Spans, pipe: np.ndarray, names: list[str], args: list[dict[str, Any]],
            first: int) -> tuple[tuple[int, str, int, int, int, int], ...]:
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
            k = a.get("stage", first) if n != "step" else first
            out.append((st, n, int(mb) if isinstance(mb, int) else -1, int(sp.start[i]),
                        int(sp.end[i]), int(k) if isinstance(k, int) else first))
    return tuple(sorted(out, key=lambda b: (b[0], b[3])))


def _ran(s: Stage) -> list[tuple[str, int]]:
    """The stage's forward and backward microbatches in the order it ran them, in every
    step of its kept blocks alike ([] when steps differ or none was kept)."""
    per: dict[int, list[tuple[str, int]]] = {}
    for step, name, mb, *_ in s.blocks:
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


def combine(stages: list[Stage], extra: list[int] | None = None,
            calibration: Calibration | None = None, probe: pp_probed.Probe | None = None
            ) -> Pipeline | None:
    """The pipeline of the ranks' stages (one or several per rank), with its what-ifs: the
    microbatch counts in `extra` (default: half and double the measured), the other
    schedules, and the layers rebalanced; `calibration`: another run of it at another
    microbatch count, to fit each stage's compute per microbatch (pp_whatif); `probe`: the
    job's own timing of its stages at other microbatch sizes (pp_probed), used without one."""
    st = sorted((s for s in stages if s.stage >= 0), key=lambda s: (s.stage, s.rank))
    if not st:
        return None
    # several ranks per stage (pipeline x data parallel: a pipeline per replica): a stage's
    # times are its replicas' mean
    by: dict[int, list[tuple[Stage, tuple[float, float, float]]]] = {}
    for s in st:
        held = s.by_stage or {s.stage: (s.forward_s, s.backward_s, 0.0)}
        for k, t in held.items():
            by.setdefault(k, []).append((s, t))
    n = max(st[0].num_stages, len(by))
    if sorted(by) != list(range(n)):
        return None   # not every stage was recorded: no replay
    v = max(len(s.held) for s in st) or 1
    p = max(n // v, 1)

    def mean(stage: int, f: Any) -> float:
        return float(np.mean([f(x, t) for x, t in by[stage]]))

    m, sched = st[0].microbatches, st[0].schedule
    recorded = ""
    if v == 1 and sched not in pipesim.SHORT:
        # a schedule of another library (DeepSpeed's TrainSchedule) replays as the known one
        # whose order every stage ran
        ran = [_ran(by[k][0][0]) for k in range(n)]
        same = [s for s in pipesim.SCHEDULES
                if all(o and o == pipesim.order(s, k, n, m) for k, o in enumerate(ran))]
        if same:
            recorded, sched = sched, same[0]
    fwd = [mean(k, lambda x, t: t[0]) for k in range(n)]
    bwd = [mean(k, lambda x, t: t[1]) for k in range(n)]
    wgt = [mean(k, lambda x, t: t[2]) for k in range(n)]
    own = [tuple(float(np.mean([x.own.get(k, (0.0, 0.0))[i] for x, _ in by[k]]))
                 for i in (0, 1)) for k in range(n)]
    loss = mean(n - 1, lambda x, t: x.loss_s)
    # the pipeline's makespan is the first stage's step: it starts the first forward and
    # (GPipe, 1F1B) ends the last backward; a later stage's step also holds its wait for
    # the first stage to start (ranks that left the previous iteration early)
    step = mean(0, lambda x, t: x.step_s)
    try:
        lay = pporders.layout(sched, p, v, m)
        why = ""
    except ValueError as e:
        lay, why = None, str(e)
    # the schedule's own work per microbatch with the compute, the transfer fitted to the
    # rest (the own work scaled down where the replay with it alone outlasts the step)
    own, transfer = pp_fit.fit_own(lay, fwd, bwd, wgt, own, loss, step) if lay else \
        (own, 0.0)
    f1 = [f + o for f, (o, _) in zip(fwd, own, strict=True)]
    b1 = [b + o for b, (_, o) in zip(bwd, own, strict=True)]
    base = pipesim.run(lay.orders, lay.rank_of, f1, b1, wgt, transfer, loss).makespan \
        if lay else step
    outside = mean(0, lambda x, t: x.t_iter - x.step_s)
    slowest = max(st, key=lambda x: x.busy_s).stage
    one = first_replica_of(st)
    out = Pipeline(st, sched, m, n, float(np.mean([s.bubble_s / s.t_iter for s in st
                                                   if s.t_iter > 0])),
                   pipesim.theory(p, m, v), slowest, transfer, base,
                   bubble_step=float(np.mean([min(s.bubble_s / s.step_s, 1.0) for s in st
                                              if s.step_s > 0])),
                   per_stage=(tuple(fwd), tuple(bwd), loss, outside),
                   recorded_schedule=recorded, ranks=p, stages_per_rank=v,
                   weight=tuple(wgt), own=tuple(own), rank_of=tuple(
                       next((x.rank for x in one if k in (x.held or (x.stage,))), -1)
                       for k in range(n)), replay_note=why)
    if lay is None:
        return out
    return _calibrated(out, calibration, one, extra, probe)


def as_dict(pl: Pipeline) -> dict[str, Any]:
    """`--json`'s pipeline section."""
    return {"schedule": pl.schedule, "recorded_schedule": pl.recorded_schedule or pl.schedule,
            "microbatches": pl.microbatches,
            "num_stages": pl.num_stages, "bubble": pl.bubble, "bubble_step": pl.bubble_step,
            "theory": pl.theory,
            "slowest_stage": pl.slowest, "transfer_s": pl.transfer_s,
            "replayed_step_s": pl.replayed_step_s,
            "stages": [{k: v for k, v in vars(s).items()
                        if k not in ("layers", "blocks", "by_stage", "held", "own")} | {
                "busy_s": s.busy_s, "held": list(s.held or (s.stage,))} for s in pl.stages],
            "ranks": pl.ranks, "stages_per_rank": pl.stages_per_rank,
            "per_stage": [{"stage": k, "rank": r, "forward_s": f, "backward_s": b,
                           "backward_weight_s": w} for k, (r, f, b, w) in enumerate(zip(
                               pl.rank_of, pl.per_stage[0], pl.per_stage[1], pl.weight,
                               strict=False))],
            "replay_unavailable": pl.replay_note or None,
            "calibration": pl.calibration_used or None,
            "probe_unused": pl.probe_note or None,
            "what_if": [vars(w) | {"band": list(w.band) if w.band else None}
                        for w in pl.what_if], "assumptions": list(pl.assumptions),
            "compute": pl.compute.as_dict() | (
                {"calibration_unused": pl.calibration_note} if pl.calibration_note else {}),
            "headline": pl.headline()}
