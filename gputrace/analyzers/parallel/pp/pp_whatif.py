"""A pipeline's what-ifs: its iteration replayed (pipesim) with more or fewer microbatches,
the other schedule, or the layers moved between stages to balance them, from each stage's
compute per microbatch as the microbatch count changes (the global batch kept).

One run gives each stage's time per microbatch at one size: the what-if takes its compute
(the module's forward, the backward's autograd) as proportional to the microbatch's size
and the schedule's own work per microbatch (Pipeline.own: around the compute in its chunks
and between them) as the same at any size (stated), and says how far such a prediction was
measured from the run it predicts (BAND). A second run of the same job at another
microbatch count (`analyze --calibrate OTHER`) gives two sizes: each stage's forward,
backward and loss are then fitted per microbatch as fixed + per-sample,
t(m) = a + b / m (a: what a microbatch costs whatever its size, as reading the stage's
weights and launching its work; b / m: its share of the global batch), and the what-if
replays the fitted times. A smaller microbatch's lower efficiency is then predicted."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from gputrace.analyzers.parallel import whatif_bands as wb
from gputrace.analyzers.parallel.pp import pipesim, pp_fit, pp_probed, pp_stage_times, pporders
from gputrace.analyzers.parallel.pp.pp_model import (  # noqa: F401 - the what-ifs' records
    ASSUMPTIONS,
    FITTED,
    FITTED_SEVERAL,
    PROPORTIONAL,
    REST,
    REST_FITTED,
    SPLIT_HALF,
    SPLIT_PROBED,
    Calibration,
    Compute,
    Pipeline,
    Stage,
    WhatIf,
)

SAME_BATCH = 0.10   # the two runs' bytes between stages per iteration agree this closely
# how far a microbatch-count what-if was from the run at that count it predicts, measured
# (analyzers.parallel.whatif_bands: of one run to fewer microbatches and to more, and fitted)
BAND = {k: wb.KINDS[f"pp_{k}"].band for k in ("fewer", "more", "fitted", "probed")}
BAND_WHERE = wb.KINDS["pp_fitted"].where


def split_changed(recorded: str, schedule: str) -> bool:
    """Whether one of the two schedules splits the backward into its input and weight parts
    (zero bubble) and the other does not: the split's own cost is then not predicted."""
    return (recorded in pporders.SPLIT) != (schedule in pporders.SPLIT)


def kind_of(pl: Pipeline, schedule: str, v: int) -> str | None:
    """The measured kind (whatif_bands) of a what-if with `schedule` at `v` stages per rank
    at the recorded microbatch count: across a fused and a split backward, between stage
    counts per rank, or between schedules alike in both (None: the recorded layout)."""
    if split_changed(pl.schedule, schedule):
        return "pp_split_probed" if pl.split_probed else "pp_split"
    if v != pl.stages_per_rank:
        return "pp_stages"
    return "pp_schedule" if schedule != pl.schedule else None


BALANCED = "layers balanced across stages"   # the layers what-if's `what` begins so


def schedule_kinds(pl: Pipeline) -> list[str]:
    """The measured kinds of the pipeline's what-ifs at the recorded microbatch count whose
    error is shown, in the order band_note names them."""
    kinds = {"pp_layers" if w.what.startswith(BALANCED) else
             kind_of(pl, w.schedule, w.stages_per_rank) for w in pl.what_if}
    return [k for k in ("pp_schedule", "pp_stages", "pp_split", "pp_split_probed",
                        "pp_layers")
            if k in kinds and wb.band(k) is not None]


def _wider(a: tuple[float, float] | None, b: tuple[float, float] | None
           ) -> tuple[float, float] | None:
    """The band that holds both (None where neither is given)."""
    if a is None or b is None:
        return a or b
    return (min(a[0], b[0]), max(a[1], b[1]))


_KIND_WORDS = {
    "pp_schedule": "a schedule what-if between schedules at the same stages per rank, how "
                   "far such a what-if was from the run of that schedule",
    "pp_stages": "a schedule what-if between stage counts per rank, how far such a what-if "
                 "was from the run of that schedule",
    "pp_split": "a schedule what-if between a fused backward and one split into its input "
                "and weight parts (zero bubble), how far such a what-if was from the run of "
                "that schedule",
    "pp_split_probed": "a schedule what-if between a fused backward and one split into its "
                       "input and weight parts, the split's cost from the job's probe, how "
                       "far such a what-if was from the run of that schedule",
    "pp_layers": "the layers balanced across stages, how far such a what-if was from the run "
                 "of the model cut so",
}


def band_note(c: Compute, kinds: Sequence[str] = ()) -> str:
    """What the what-ifs' `band` is, in words (`kinds`: the schedule what-ifs' measured
    kinds shown with a band, schedule_kinds)."""
    if c.calibrated_with:
        out = ("measured error: how far such a what-if, fitted with a run at another "
               f"count, was from the run at its count ({BAND_WHERE}; bench/README.md)")
    elif c.probed:
        out = ("measured error: how far such a what-if, its compute timed by the job's "
               "probe at other sizes (record --pp-probe), was from the run at its count "
               f"({wb.KINDS['pp_probed'].where}; bench/README.md)")
    else:
        out = ("measured error: how far such a what-if was from the run at that microbatch "
               f"count ({wb.KINDS['pp_fewer'].where}: to fewer microbatches; to more, "
               f"{wb.KINDS['pp_more'].where.removeprefix(wb.PP_RUNS).lstrip()}; "
               "bench/README.md): recording with --pp-probe (each "
               "stage timed by the job at other microbatch sizes) or --calibrate with a run "
               "at another count takes the compute per microbatch from the job instead")
    for k in kinds:
        out += f"; {_KIND_WORDS[k]} ({wb.KINDS[k].where})"
    return out


def _refused(cal: Calibration, n: int, m: int, p2p_bytes: float) -> str:
    """Why `cal` cannot calibrate this run ("" when it can)."""
    if len(cal.forward_s) != n:
        return (f"the calibrating run has {len(cal.forward_s)} stages, this one {n}: its "
                "compute per microbatch is another stage's (a calibrating run needs the "
                "same stages, under any schedule)")
    if cal.microbatches == m:
        return (f"the calibrating run has the same {m} microbatches: nothing to fit (it "
                "needs another microbatch count)")
    if p2p_bytes > 0 and cal.p2p_bytes > 0 and abs(cal.p2p_bytes / p2p_bytes - 1) > SAME_BATCH:
        return (f"the calibrating run moves {cal.p2p_bytes / p2p_bytes:.2f}x the bytes "
                "between stages per iteration: another global batch or model")
    return ""


def compute(fwd: Sequence[float], bwd: Sequence[float], loss: float, m: int,
            p2p_bytes: float, cal: Calibration | Sequence[Calibration] | None
            ) -> tuple[Compute, str]:
    """The stages' compute model, and why a calibration given was not used ("" when it
    was, or none was given). Several calibrating runs: those that fit, each at its own
    microbatch count, with this run give the times at three or more counts."""
    plain = Compute(tuple((0.0, x * m) for x in fwd), tuple((0.0, x * m) for x in bwd),
                    (0.0, loss * m))
    if cal is None:
        return plain, ""
    cals = [cal] if isinstance(cal, Calibration) else list(cal)
    why = [w for w in (_refused(c, len(fwd), m, p2p_bytes) for c in cals) if w]
    ok: dict[int, Calibration] = {}
    for c in cals:
        if not _refused(c, len(fwd), m, p2p_bytes):
            ok.setdefault(c.microbatches, c)
    if not ok:
        return plain, "; ".join(why)
    near = min(ok.values(), key=lambda c: abs(c.microbatches - m))
    m1 = near.microbatches
    out = Compute(tuple(pp_fit.line(a, m, b, m1)
                        for a, b in zip(fwd, near.forward_s, strict=True)),
                  tuple(pp_fit.line(a, m, b, m1)
                        for a, b in zip(bwd, near.backward_s, strict=True)),
                  pp_fit.line(loss, m, near.loss_s, m1), m1)
    if len(ok) >= 2:
        pts = [(m, tuple(fwd), tuple(bwd), loss)] + [
            (c.microbatches, c.forward_s, c.backward_s, c.loss_s) for c in ok.values()]
        out = replace(out, points=tuple(sorted(pts, key=lambda q: q[0])))
    return out, "; ".join(why)


def calibration_of(pl: Pipeline) -> Calibration:
    """What a run's pipeline gives another run's what-ifs."""
    f, b, loss, _ = pl.per_stage
    return Calibration(pl.microbatches, tuple(f), tuple(b), loss,
                       float(sum(s.p2p_bytes for s in pl.stages)), pl.schedule,
                       tuple(pl.own), pl.transfer_s)


# the schedules a pipeline's what-ifs replay, with their stages per rank
CANDIDATES = (("ScheduleGPipe", 1), ("Schedule1F1B", 1), ("ScheduleInterleaved1F1B", 2),
              ("ScheduleZBVZeroBubble", 2))


def what_ifs(pl: Pipeline, stages: list[Stage], extra: list[int] | None = None
             ) -> list[WhatIf]:
    """The microbatch counts in `extra` (default: half and double the measured), the other
    schedules (and, interleaved, twice the stages per rank), and the layers rebalanced
    (`stages`: the first replica's ranks, their layers; one stage per rank)."""
    m, p, sched, v = pl.microbatches, pl.ranks or pl.num_stages, pl.schedule, \
        pl.stages_per_rank
    ifs = []

    def add(*a: Any, **k: Any) -> None:
        try:
            ifs.append(predict(pl, *a, **k))
        except ValueError:      # a schedule that does not run so (torch's own rule)
            pass

    for m2 in sorted(set(extra or [max(p, m // 2), m * 2]) - {m}):
        if m2 >= 1:
            add(sched, m2)
    more = [(sched, 2 * v)] if sched == "ScheduleInterleaved1F1B" else []
    for other, v2 in (*CANDIDATES, *more):
        if (other, v2) != (sched, v):
            add(other, m, v=v2)
    f0, b0, _, _ = pl.per_stage
    own = [a + b for a, b in pl.own] if len(pl.own) == len(f0) else None
    moved = _balanced(stages, list(f0), list(b0), own) if v == 1 else None
    if moved is not None:
        fwd, bwd, counts = moved
        now = " + ".join(str(len(s.layers)) for s in stages)
        add(sched, m, fwd, bwd, kind="pp_layers",
            what=f"{BALANCED}: {' + '.join(map(str, counts))} layers (now {now})")
    return ifs


def predict(pl: Pipeline, schedule: str, m: int, fwd: list[float] | None = None,
            bwd: list[float] | None = None, what: str = "", v: int | None = None,
            kind: str | None = None) -> WhatIf:
    """The pipeline's iteration replayed with `schedule` over `m` microbatches (the global
    batch kept) at `v` stages per rank (the schedule's own, else the recorded), each
    stage's compute per microbatch from pl.compute at m (or `fwd`/`bwd` per stage: its
    times per microbatch at m). ValueError where the schedule does not run so."""
    v = pporders.stages_per_rank(schedule, v or pl.stages_per_rank)
    p = pl.ranks or pl.num_stages
    lay = pporders.layout(schedule, p, v, m)
    f, b, loss = pl.compute.at(m, own=False)
    own, transfer = pp_fit.rest_at(pl.compute.rest, m) if pl.compute.rest else \
        (list(pl.own), pl.transfer_s)
    if own_scales(pl) and m != pl.microbatches:
        f0, b0, _ = pl.compute.at(pl.microbatches, own=False)
        own = [(of * (x / x0 if x0 > 0 else 1.0), ob * (y / y0 if y0 > 0 else 1.0))
               for (of, ob), x, x0, y, y0 in zip(own, f, f0, b, b0, strict=True)]
    f, b, w, _ = pp_stage_times.under(pl, schedule, v, fwd or f, bwd or b, own)
    r = pipesim.run(lay.orders, lay.rank_of, f, b, w, transfer, loss)
    t_iter = r.makespan + pl.per_stage[3]
    idle = float(np.mean(r.bubble))
    if not what:
        per = f", {v} stages per rank" if v > 1 and (schedule != pl.schedule or
                                                      v != pl.stages_per_rank) else ""
        what = (f"{m} microbatches" if schedule == pl.schedule and not per else
                f"{pipesim.SHORT.get(schedule, schedule)} schedule{per}" + (
                    f", {m} microbatches" if m != pl.microbatches else ""))
    band = None
    if m != pl.microbatches:
        band = BAND["fitted" if pl.compute.calibrated_with else "probed" if
                    pl.compute.probed else "fewer" if m < pl.microbatches else "more"]
    # the measured kind: the layout's, or the caller's where the layout does not tell (the
    # layers moved between stages: pp_layers)
    band = _wider(band, wb.band(kind or kind_of(pl, schedule, v)))
    return WhatIf(what, schedule, m, t_iter, idle / t_iter if t_iter > 0 else 0.0, idle,
                  band, v)


def own_scales(pl: Pipeline) -> bool:
    """Whether each stage's own work per microbatch is taken at another count as its probed
    compute scales: DeepSpeed's pipeline engine (its passes copy the activations around the
    module; bench/README.md, "DeepSpeed's pipeline, probed": 18 of 36 predictions within
    10 % so, 12 with the own work kept), probed, with no calibrating run. Elsewhere the own
    work stays (torch.distributed.pipelining's, over 96 predictions: as close either way,
    and wider at the worst scaled)."""
    return bool(pl.compute.probed and not pl.compute.rest and pl.own and
                pl.recorded_schedule in pp_probed.OWN_SCALES)


def probed(pl: Pipeline, probe: pp_probed.Probe | None, model: Compute
           ) -> tuple[Compute, str, str]:
    """The compute model from the job's probe (record --pp-probe) where no calibrating run
    was used: (model, its assumption, "") or (model unchanged, "", why not)."""
    if probe is None:
        return model, "", ""
    if model.calibrated_with:
        return model, "", "--calibrate's runs measured other microbatch counts"
    f, b, loss, _ = pl.per_stage
    pts, why = pp_probed.points(probe, pl.microbatches, list(f), list(b), loss)
    if not pts:
        return model, "", why
    m = pl.microbatches
    near = min((p for p in pts if p[0] != m), key=lambda p: abs(p[0] - m))

    def lines(now: Sequence[float], other: Sequence[float]) -> tuple[tuple[float, float], ...]:
        return tuple(pp_fit.line(x, m, y, near[0]) for x, y in zip(now, other, strict=True))
    out = replace(model, forward=lines(f, near[1]), backward=lines(b, near[2]),
                  loss=pp_fit.line(loss, m, near[3], near[0]),
                  points=pts if len(pts) >= 3 else (), probed=probe.stages[0][0])
    return out, pp_probed.assumption(probe, pl.recorded_schedule), ""


def calibrated(pl: Pipeline, cal: Calibration | Sequence[Calibration] | None, stages: list[Stage],
               extra: list[int] | None = None, probe: pp_probed.Probe | None = None
               ) -> Pipeline:
    """`pl` with its compute model (fitted when `cal` fits, else from the job's probe
    where it has one) and its what-ifs."""
    f, b, loss, _ = pl.per_stage
    model, why = compute(f, b, loss, pl.microbatches,
                         float(sum(s.p2p_bytes for s in pl.stages)), cal)
    model, by_probe, probe_note = probed(pl, probe, model)
    first = FITTED.format(m=model.calibrated_with) if model.calibrated_with else \
        by_probe or PROPORTIONAL
    if model.points and not model.probed:
        first = FITTED_SEVERAL.format(ms=", ".join(str(q[0]) for q in model.points))
    cals = [] if cal is None or not model.calibrated_with else \
        [cal] if isinstance(cal, Calibration) else list(cal)
    used = "; ".join(
        f"the {pipesim.SHORT.get(c.schedule, c.schedule) or 'other'} run at {c.microbatches} "
        "microbatches" for c in cals
        if c.microbatches in ([q[0] for q in model.points] or [model.calibrated_with]))
    counts = [q[0] for q in model.points] or [model.calibrated_with]
    runs = {pl.microbatches: (tuple(pl.own), pl.transfer_s)} if pl.own else {}
    for c in cals:
        if c.microbatches in counts and len(c.own) == len(f) and c.transfer_s is not None:
            runs.setdefault(c.microbatches, (c.own, c.transfer_s))
    rest = tuple(sorted((k, o, t) for k, (o, t) in runs.items())) if len(runs) >= 2 else ()
    if used:
        used += (": each stage's compute per microbatch fitted through it and this run" +
                 (", and the schedule's own work and transfer" if rest else ""))
    model = replace(model, own=tuple(pl.own), rest=rest)
    split = pp_probed.split_parts(probe, pl.microbatches, len(f))
    rest_words = tuple(SPLIT_PROBED if x == SPLIT_HALF and split else x
                       for x in (REST_FITTED if rest else REST))
    out = replace(pl, compute=model, calibration_note=why, calibration_used=used,
                  assumptions=(first, *rest_words), probe_note=probe_note,
                  split_probed=split)
    return replace(out, what_if=what_ifs(out, stages, extra))


def _balanced(st: list[Stage], fwd: list[float], bwd: list[float],
              own: list[float] | None = None
              ) -> tuple[list[float], list[float], list[int]] | None:
    """Stage times with the layers cut where they balance (by their backward time; a
    stage's forward split in the same proportions), None when the layers are not known or
    the cut stays. `st`: one rank per stage (its layers); `fwd`, `bwd`: each stage's; `own`:
    each stage's own work per microbatch, which stays with the stage whatever layers it
    holds (the last stage's loss and the schedule's work around its chunks: a cut by the
    layers alone could load the stage that already carries the most)."""
    layers: list[tuple[float, float]] = []    # (backward, forward) per layer, in order
    for s, f_s, b_s in zip(st, fwd, bwd, strict=True):
        tot = sum(s.layers.values())
        if not s.layers or tot <= 0:
            return None
        for b in s.layers.values():
            share = b / tot
            layers.append((b_s * share, f_s * share))
    cuts = pipesim.balance([b + f for b, f in layers], len(st), own)
    now, at = [], 0
    for s in st[:-1]:
        at += len(s.layers)
        now.append(at)
    if cuts == now:
        return None
    bounds = [0, *cuts, len(layers)]
    fwd = [sum(f for _, f in layers[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]
    bwd = [sum(b_ for b_, _ in layers[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]
    return fwd, bwd, [b - a for a, b in zip(bounds, bounds[1:], strict=False)]
