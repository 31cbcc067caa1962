"""A pipeline's measured shape and its what-ifs' records: each rank's stage, the pipeline
across its ranks, a stage's compute per microbatch as the microbatch count changes, a
calibrating run, a what-if, and the assumptions the what-ifs state. Data only: pp.py
measures them, pp_whatif.py replays them, pp_timeline.py lays one iteration out."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gputrace.analyzers.parallel.pp import pipesim, pp_fit

PROPORTIONAL = (
    "the global batch stays: a microbatch's forward and backward compute (the module's "
    "forward, the backward's autograd) take the measured time x m/m' (proportional to its "
    "size) under either schedule, the schedule's own work per microbatch (around them in "
    "its chunks, and between its chunks less its waits) the measured time at any size (a "
    "smaller microbatch's lower efficiency inside its compute, or a schedule's smaller "
    "activation footprint computing faster, is not predicted; `--calibrate` with a run at "
    "another microbatch count fits it)")
FITTED = (
    "the global batch stays: each stage's forward, backward and loss per microbatch are "
    "fitted as fixed + per-sample from this run and the calibrating run at {m} "
    "microbatches (t = a + b/m), under either schedule (a schedule's smaller activation "
    "footprint computing faster is not predicted)")
SPLIT_HALF = (
    "a schedule that splits the backward (zero bubble) computes its weight part in the "
    "recorded share of it, half where the recorded schedule did not split it (a Linear "
    "layer's gradients of its input and of its weights take as many FLOPs; the first "
    "stage's input part is empty, its weight part the whole backward, as torch's schedules "
    "run it), and the split backward costs what the recorded one did (torch's split "
    "backward was measured at "
    "1.16-1.44 times the fused one per microbatch on a CPU: a what-if between the two is "
    "shown with that measured error); a stage count per rank other than the recorded splits "
    "each rank's compute evenly over its stages")
SPLIT_PROBED = (
    "a schedule that splits the backward (zero bubble) computes its input and weight parts "
    "as the job's probe timed each stage's split against its fused backward (`record "
    "--pp-probe`: torch's own split, at the recorded rows): the split backward that ratio "
    "of the fused one, the weight part its probed share (the recorded share where the "
    "recorded schedule split it), and back; the first stage's input part is empty, its "
    "weight part the whole backward (torch's schedules run it so); a stage count per rank "
    "other than the recorded splits each rank's compute evenly over its stages")
FITTED_SEVERAL = (
    "the global batch stays: each stage's forward, backward and loss per microbatch are "
    "measured at {ms} microbatches (this run and the calibrating ones); at another count "
    "they are fitted as t = a + b/m through the two measured counts around it (the nearest "
    "two beyond them: an extrapolation), under any schedule")
REST = (
    SPLIT_HALF,
    "a transfer between stages costs what replaying the measured schedule (its own work "
    "per microbatch included) needs to give the measured step (fitted once), the same per "
    "transfer at any microbatch count (latency, not bandwidth, bound)",
    "the update and the time outside the schedule's step stay as measured")
# with calibrating runs: the transfer and the schedule's own work as measured at each count
REST_FITTED = (
    SPLIT_HALF,
    "a transfer between stages and the schedule's own work per microbatch, each what "
    "replaying that run's schedule needs to give its step, are taken at another count on "
    "the line a + b/m through the two runs whose counts lie nearest it (never below 0), as "
    "the compute: at a run's own count, that run's",
    REST[2])
ASSUMPTIONS = (PROPORTIONAL, *REST)

@dataclass(frozen=True)
class WhatIf:
    what: str
    schedule: str
    microbatches: int
    t_iter: float
    bubble: float         # share of the iteration (as Pipeline.bubble), mean over stages
    bubble_s: float       # per iteration, mean over stages: replayed step time computing nothing
    # how far such a what-if was from the run it predicts, measured (BAND): (lowest,
    # highest) of predicted / measured - 1; None where it was measured within 10 %
    band: tuple[float, float] | None = None
    stages_per_rank: int = 1   # v of the what-if's layout (the schedule's own where fixed)


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
    # per stage, its schedule's own work per microbatch (forward, backward), and the
    # transfer fitted to its step (None: not known)
    own: tuple[tuple[float, float], ...] = ()
    transfer_s: float | None = None


@dataclass(frozen=True)
class Compute:
    """Per stage, a microbatch's forward and backward at m microbatches: a + b / m, as
    (a, b); the last stage's loss the same. `calibrated_with`: the other run's microbatch
    count (0: proportional, a = 0)."""

    forward: tuple[tuple[float, float], ...]
    backward: tuple[tuple[float, float], ...]
    loss: tuple[float, float]
    calibrated_with: int = 0
    # three or more runs (this one and the calibrating ones): per microbatch count, each
    # stage's forward and backward and the loss as measured, m ascending; `at` then takes
    # a + b / m through the two counts nearest m (between them where m lies between two)
    points: tuple[tuple[int, tuple[float, ...], tuple[float, ...], float], ...] = ()
    # per stage, the schedule's own work per microbatch (forward, backward), measured in
    # this run: added at any m (Pipeline.own)
    own: tuple[tuple[float, float], ...] = ()
    # with calibrating runs: per run used (this one too), m ascending, each stage's own work
    # per microbatch and the transfer; the what-ifs take both at m through them
    # (pp_fit.rest_at) instead of this run's own work and transfer at any m
    rest: tuple[pp_fit.Rest, ...] = ()
    # the rows at which the job's own probe timed each stage (record --pp-probe; `points`
    # then hold the measured times scaled by it, pp_probed), () where it was not used
    probed: tuple[int, ...] = ()

    def at(self, m: int, own: bool = True) -> tuple[list[float], list[float], float]:
        """Per stage, a microbatch's forward and backward at m (the schedule's own work
        included unless `own` is False), and the loss."""
        if len(self.points) >= 3:
            f0, b0, loss = pp_fit.piecewise(self.points, m)
        else:
            def f(ab: tuple[float, float]) -> float:
                return ab[0] + ab[1] / m
            f0, b0, loss = [f(x) for x in self.forward], [f(x) for x in self.backward], \
                f(self.loss)
        if own and self.own:
            f0 = [x + o for x, (o, _) in zip(f0, self.own, strict=True)]
            b0 = [x + o for x, (_, o) in zip(b0, self.own, strict=True)]
        return f0, b0, loss

    def as_dict(self) -> dict[str, Any]:
        return {"model": "fitted" if self.calibrated_with else "probed" if self.probed
                else "proportional",
                "probed_rows": list(self.probed) or None,
                "calibrated_with": self.calibrated_with or None,
                "measured_at": [q[0] for q in self.points] or None,
                "forward": [{"fixed_s": a, "per_batch_s": b} for a, b in self.forward],
                "backward": [{"fixed_s": a, "per_batch_s": b} for a, b in self.backward],
                "loss": {"fixed_s": self.loss[0], "per_batch_s": self.loss[1]},
                "schedule_own": [{"forward_s": f, "backward_s": b} for f, b in self.own],
                "schedule_own_at": [
                    {"microbatches": m, "transfer_s": t, "schedule_own": [
                        {"forward_s": f, "backward_s": b} for f, b in o]}
                    for m, o, t in self.rest] or None}


@dataclass(frozen=True)
class Stage:
    """One rank's stage (its stages: `held`, several under the interleaved and V schedules),
    means over the analyzed iterations."""

    rank: int
    stage: int            # the lowest of `held`
    schedule: str
    microbatches: int
    num_stages: int
    forward_s: float      # per microbatch (the rank's stages together)
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
    # recorded (trace ns): (step, name, microbatch, start, end, stage); the step itself
    # has mb -1 and the rank's first stage
    blocks: tuple[tuple[int, str, int, int, int, int], ...] = ()
    held: tuple[int, ...] = ()
    # per stage held: its forward, backward (weight part included) and the backward's
    # weight part (zero-bubble schedules), per microbatch
    by_stage: dict[int, tuple[float, float, float]] = field(default_factory=dict)
    # per stage held: the schedule's own work per microbatch around its forward and its
    # backward (in its chunks around the module's call or autograd, and between its chunks
    # less its waits), which no microbatch size changes
    own: dict[int, tuple[float, float]] = field(default_factory=dict)

    @property
    def busy_s(self) -> float:
        return self.microbatches * (self.forward_s + self.backward_s + self.loss_s)


BLOCK_STEPS = 9      # iterations whose pipeline spans a stage keeps (a report draws one)


@dataclass(frozen=True)
class Pipeline:
    """The pipeline across its ranks: `num_stages` stages over `ranks` ranks, each holding
    `stages_per_rank` of them (1 under GPipe and 1F1B)."""

    stages: list[Stage]   # one per rank (its stages: Stage.held)
    schedule: str
    microbatches: int
    num_stages: int
    bubble: float         # mean over ranks: bubble / iteration
    theory: float         # (p-1)/(v m+p-1), a share of the schedule's step
    slowest: int          # stage index (of the busiest rank: its first stage)
    transfer_s: float     # fitted (pipesim.fit_transfer)
    replayed_step_s: float
    what_if: list[WhatIf] = field(default_factory=list)
    assumptions: tuple[str, ...] = ASSUMPTIONS
    bubble_step: float = 0.0   # mean over ranks: bubble / the schedule's step (as theory)
    # per stage, its replicas averaged: forward and backward per microbatch; the last
    # stage's loss; the first stage's iteration outside its step
    per_stage: tuple[tuple[float, ...], tuple[float, ...], float, float] = ((), (), 0.0, 0.0)
    compute: Compute = Compute((), (), (0.0, 0.0))   # per microbatch as m changes (what-ifs)
    calibration_note: str = ""   # why a calibrating run given was not used
    recorded_schedule: str = ""  # the recorded schedule replayed as `schedule` (its order)
    ranks: int = 0               # the pipeline's ranks (one replica)
    stages_per_rank: int = 1
    weight: tuple[float, ...] = ()    # per stage, the backward's weight part (split ones)
    # per stage, the schedule's own work per microbatch (forward, backward): the same at
    # any microbatch size (Stage.own, scaled to the measured step where it outlasts it)
    own: tuple[tuple[float, float], ...] = ()
    rank_of: tuple[int, ...] = ()     # per stage, its rank (the first replica's)
    replay_note: str = ""        # why the recorded schedule is not replayed
    calibration_used: str = ""   # the calibrating run used, in words
    probe_note: str = ""         # why the job's probe (record --pp-probe) was not used
    # per stage, from the job's probe: its split backward over its fused one, and the
    # weight part's share of the split one (pp_probed.split_parts); () where not probed
    split_probed: tuple[tuple[float, float], ...] = ()

    def headline(self) -> str:
        name = pipesim.SHORT.get(self.schedule, self.schedule)
        if self.recorded_schedule:
            name = f"{self.recorded_schedule}, {name} order"
        per = f" ({self.stages_per_rank} per rank)" if self.stages_per_rank > 1 else ""
        return (f"pipeline, {self.num_stages} stages{per} x {self.microbatches} microbatches "
                f"({name}): bubble "
                f"{self.bubble_step:.0%} of the schedule's step ({self.bubble:.0%} of the "
                f"iteration), theory {self.theory:.0%}")
