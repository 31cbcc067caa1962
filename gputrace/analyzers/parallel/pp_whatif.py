"""A pipeline's what-ifs: its iteration replayed (pipesim) with more or fewer microbatches,
the other schedule, or the layers moved between stages to balance them, from each stage's
compute per microbatch as the microbatch count changes (the global batch kept).

One run gives each stage's time per microbatch at one size: the what-if takes it as
proportional to the microbatch's size (stated). A second run of the same job at another
microbatch count (`analyze --calibrate OTHER`) gives two sizes: each stage's forward,
backward and loss are then fitted per microbatch as fixed + per-sample,
t(m) = a + b / m (a: what a microbatch costs whatever its size, as reading the stage's
weights and launching its work; b / m: its share of the global batch), and the what-if
replays the fitted times. A smaller microbatch's lower efficiency is then predicted."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from gputrace.analyzers.parallel import pipesim

if TYPE_CHECKING:
    from gputrace.analyzers.parallel.pp import Pipeline, Stage

PROPORTIONAL = (
    "the global batch stays: a microbatch's forward and backward take the measured time x "
    "m/m' (proportional to its size) under either schedule (a smaller microbatch's lower "
    "efficiency, or a schedule's smaller activation footprint computing faster, is not "
    "predicted; `--calibrate` with a run at another microbatch count fits it)")
FITTED = (
    "the global batch stays: each stage's forward, backward and loss per microbatch are "
    "fitted as fixed + per-sample from this run and the calibrating run at {m} "
    "microbatches (t = a + b/m), under either schedule (a schedule's smaller activation "
    "footprint computing faster is not predicted)")
REST = (
    "a transfer between stages (with the schedule's own work per microbatch) costs what "
    "replaying the measured schedule needs to give the measured step (fitted once), the "
    "same per transfer at any microbatch count (latency, not bandwidth, bound)",
    "the update and the time outside the schedule's step stay as measured")
ASSUMPTIONS = (PROPORTIONAL, *REST)
SAME_BATCH = 0.10   # the two runs' bytes between stages per iteration agree this closely


@dataclass(frozen=True)
class WhatIf:
    what: str
    schedule: str
    microbatches: int
    t_iter: float
    bubble: float         # share of the iteration (as Pipeline.bubble), mean over stages
    bubble_s: float       # per iteration, mean over stages: replayed step time computing nothing


@dataclass(frozen=True)
class Calibration:
    """Another run of the same pipeline: its microbatch count and, per stage, its compute
    per microbatch; its bytes between stages per iteration (the global batch's check)."""

    microbatches: int
    forward_s: tuple[float, ...]
    backward_s: tuple[float, ...]
    loss_s: float
    p2p_bytes: float
    schedule: str = ""


@dataclass(frozen=True)
class Compute:
    """Per stage, a microbatch's forward and backward at m microbatches: a + b / m, as
    (a, b); the last stage's loss the same. `calibrated_with`: the other run's microbatch
    count (0: proportional, a = 0)."""

    forward: tuple[tuple[float, float], ...]
    backward: tuple[tuple[float, float], ...]
    loss: tuple[float, float]
    calibrated_with: int = 0

    def at(self, m: int) -> tuple[list[float], list[float], float]:
        def f(ab: tuple[float, float]) -> float:
            return ab[0] + ab[1] / m
        return [f(x) for x in self.forward], [f(x) for x in self.backward], f(self.loss)

    def as_dict(self) -> dict[str, Any]:
        return {"model": "fitted" if self.calibrated_with else "proportional",
                "calibrated_with": self.calibrated_with or None,
                "forward": [{"fixed_s": a, "per_batch_s": b} for a, b in self.forward],
                "backward": [{"fixed_s": a, "per_batch_s": b} for a, b in self.backward],
                "loss": {"fixed_s": self.loss[0], "per_batch_s": self.loss[1]}}


def _fit(t0: float, m0: int, t1: float, m1: int) -> tuple[float, float]:
    """(a, b) of t = a + b/m through (m0, t0) and (m1, t1); a and b never negative (a
    run whose smaller microbatches cost less per sample is taken as proportional to the
    size, a smaller microbatch that costs more in all as fixed)."""
    b = (t0 - t1) / (1 / m0 - 1 / m1)
    a = t0 - b / m0
    if b < 0:
        return t0, 0.0
    if a < 0:
        return 0.0, t0 * m0
    return a, b


def compute(fwd: Sequence[float], bwd: Sequence[float], loss: float, m: int,
            p2p_bytes: float, cal: Calibration | None) -> tuple[Compute, str]:
    """The stages' compute model, and why a calibration given was not used ("" when it
    was, or none was given)."""
    plain = Compute(tuple((0.0, x * m) for x in fwd), tuple((0.0, x * m) for x in bwd),
                    (0.0, loss * m))
    if cal is None:
        return plain, ""
    if len(cal.forward_s) != len(fwd):
        return plain, (f"the calibrating run has {len(cal.forward_s)} stages, this one "
                       f"{len(fwd)}: not the same pipeline")
    if cal.microbatches == m:
        return plain, (f"the calibrating run has the same {m} microbatches: nothing to fit "
                       "(it needs another microbatch count)")
    if p2p_bytes > 0 and cal.p2p_bytes > 0 and \
            abs(cal.p2p_bytes / p2p_bytes - 1) > SAME_BATCH:
        return plain, (f"the calibrating run moves {cal.p2p_bytes / p2p_bytes:.2f}x the "
                       "bytes between stages per iteration: another global batch or model")
    m1 = cal.microbatches
    return Compute(tuple(_fit(a, m, b, m1) for a, b in zip(fwd, cal.forward_s, strict=True)),
                   tuple(_fit(a, m, b, m1) for a, b in zip(bwd, cal.backward_s,
                                                           strict=True)),
                   _fit(loss, m, cal.loss_s, m1), m1), ""


def calibration_of(pl: Pipeline) -> Calibration:
    """What a run's pipeline gives another run's what-ifs."""
    f, b, loss, _ = pl.per_stage
    return Calibration(pl.microbatches, tuple(f), tuple(b), loss,
                       float(sum(s.p2p_bytes for s in pl.stages)), pl.schedule)


def what_ifs(pl: Pipeline, stages: list[Stage], extra: list[int] | None = None
             ) -> list[WhatIf]:
    """The microbatch counts in `extra` (default: half and double the measured), the other
    schedule, and the layers rebalanced (`stages`: one rank per stage, its layers)."""
    m, p, sched = pl.microbatches, pl.num_stages, pl.schedule
    ifs = []
    for m2 in sorted(set(extra or [max(p, m // 2), m * 2]) - {m}):
        if m2 >= 1 and (sched != "Schedule1F1B" or m2 >= p):   # torch's 1F1B needs m >= p
            ifs.append(predict(pl, sched, m2))
    other = next(s for s in pipesim.SCHEDULES if s != sched)
    if other != "Schedule1F1B" or m >= p:
        ifs.append(predict(pl, other, m))
    f0, b0, _, _ = pl.per_stage
    moved = _balanced(stages, list(f0), list(b0))
    if moved is not None:
        ifs.append(predict(pl, sched, m, *moved, what="layers balanced across stages"))
    return ifs


def predict(pl: Pipeline, schedule: str, m: int, fwd: list[float] | None = None,
            bwd: list[float] | None = None, what: str = "") -> WhatIf:
    """The pipeline's iteration replayed with `schedule` over `m` microbatches (the global
    batch kept), each stage's compute per microbatch from pl.compute at m (or `fwd`/`bwd`
    per stage: its times per microbatch at m)."""
    if schedule not in pipesim.SCHEDULES or pl.schedule not in pipesim.SCHEDULES:
        raise ValueError(f"no replay of {schedule} from {pl.schedule}")
    f, b, loss = pl.compute.at(m)
    r = pipesim.replay(schedule, fwd or f, bwd or b, m, pl.transfer_s, loss)
    t_iter = r.makespan + pl.per_stage[3]
    idle = float(np.mean(r.bubble))
    if not what:
        what = (f"{m} microbatches" if schedule == pl.schedule else
                f"{pipesim.SHORT[schedule]} schedule" + (
                    f", {m} microbatches" if m != pl.microbatches else ""))
    return WhatIf(what, schedule, m, t_iter, idle / t_iter if t_iter > 0 else 0.0, idle)


def calibrated(pl: Pipeline, cal: Calibration | None, stages: list[Stage],
               extra: list[int] | None = None) -> Pipeline:
    """`pl` with its compute model (fitted when `cal` fits) and its what-ifs."""
    f, b, loss, _ = pl.per_stage
    model, why = compute(f, b, loss, pl.microbatches,
                         float(sum(s.p2p_bytes for s in pl.stages)), cal)
    first = FITTED.format(m=model.calibrated_with) if model.calibrated_with else PROPORTIONAL
    out = replace(pl, compute=model, calibration_note=why, assumptions=(first, *REST))
    return replace(out, what_if=what_ifs(out, stages, extra))


def _balanced(st: list[Stage], fwd: list[float], bwd: list[float]
              ) -> tuple[list[float], list[float]] | None:
    """Stage times with the layers cut where they balance (by their backward time; a
    stage's forward split in the same proportions), None when the layers are not known or
    the cut stays. `st`: one rank per stage (its layers); `fwd`, `bwd`: each stage's."""
    layers: list[tuple[float, float]] = []    # (backward, forward) per layer, in order
    for s, f_s, b_s in zip(st, fwd, bwd, strict=True):
        tot = sum(s.layers.values())
        if not s.layers or tot <= 0:
            return None
        for b in s.layers.values():
            share = b / tot
            layers.append((b_s * share, f_s * share))
    cuts = pipesim.balance([b + f for b, f in layers], len(st))
    now, at = [], 0
    for s in st[:-1]:
        at += len(s.layers)
        now.append(at)
    if cuts == now:
        return None
    bounds = [0, *cuts, len(layers)]
    fwd = [sum(f for _, f in layers[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]
    bwd = [sum(b_ for b_, _ in layers[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]
    return fwd, bwd
