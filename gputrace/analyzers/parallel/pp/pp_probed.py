"""A pipeline's compute per microbatch at other sizes from the job itself: each stage's
module timed at half and twice the microbatch's rows after the run's last iteration
(`record --pp-probe`, collectors.torch.pp_probe; the shards' metadata `pipeline.probe`).

The what-ifs at another microbatch count m' (rows r' = r m / m') take each stage's forward
and backward as measured in the run's schedule, times the probe's ratio of that stage at r'
rows to it at the recorded r (the same module, inputs and process, timed alone): the
compute's fixed part per microbatch, which one run's schedule cannot tell from its share of
the batch, comes from the probe. Between and beyond the probed sizes, on t = a + b/m through
the two nearest (pp_fit.piecewise)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


# the probe's figure of a size from its rounds: their lower quartile (another process only
# ever adds time to a round; bench/whatif_pp_inside.py --probe: over 24 predictions the
# lower quartile, the minimum, the mean and the median all gave 15 within 10 %, the worst
# +22.9, +23.6, +21.3 and +32.7 %)
def ESTIMATE(a: np.ndarray) -> float:  # noqa: N802 - the estimator, a constant of the module
    return float(np.quantile(a, 0.25))


ASSUMPTION = (
    "the global batch stays: each stage's forward and backward per microbatch at another "
    "count are the ones measured in this run's schedule times how its module's own took at "
    "that microbatch's rows against the recorded {r} (`record --pp-probe`: timed inside the "
    "job after its last iteration at {rows} rows, {rounds} rounds, their lower quartile), between and "
    "beyond those sizes on t = a + b/m through the two nearest; the last stage's loss as its "
    "forward")


# the recorded schedules whose own work per microbatch scales as the stage's probed compute
# (pp_whatif.own_scales): DeepSpeed's pipeline engine's
OWN_SCALES = ("TrainSchedule",)

# record --pp-probe was given and no process kept a stage's inputs
NOT_SEEN = ("record --pp-probe was given, but no stage of torch.distributed.pipelining or of "
            "DeepSpeed's pipeline engine ran a second schedule step in a recorded process")


@dataclass(frozen=True)
class Probe:
    """What the ranks' probes timed: per stage, (rows, forward seconds, backward seconds)
    at each size; `microbatches` and `rows`: the recorded microbatch the sizes are of."""

    microbatches: int
    rows: int
    rounds: int
    stages: dict[int, tuple[tuple[int, ...], tuple[float, ...], tuple[float, ...]]] = \
        field(default_factory=dict)
    why: str = ""     # a rank's probe that did not run, or failed: why
    # per stage, at the recorded rows: its backward split as the zero-bubble schedules
    # split it, (input part, weight part) seconds, timed beside the fused one
    split: dict[int, tuple[float, float]] = field(default_factory=dict)


def of_metadata(md: dict[str, Any]) -> Probe | None:
    """The probes of a run's shards (the first replica of each stage), None where no
    process probed or said why it did not."""
    stages: dict[int, tuple[tuple[int, ...], tuple[float, ...], tuple[float, ...]]] = {}
    split: dict[int, tuple[float, float]] = {}
    why: list[str] = []
    head: dict[str, Any] = {}
    for sh in [md, *(md.get("shards") or [])]:
        d = sh.get("pipeline") if isinstance(sh, dict) else None
        if not isinstance(d, dict):
            continue
        if isinstance(d.get("probe_skipped"), str):
            why.append(d["probe_skipped"])
        p = d.get("probe")
        if not isinstance(p, dict):
            continue
        head = head or p
        for s in p.get("stages") or []:
            try:
                k = int(s["stage"])
                if "failed" in s:
                    why.append(f"stage {k}: {s['failed']}")
                    continue
                rows = tuple(int(x) for x in s["rows"])
                f = _of(s, "forward")
                b = _of(s, "backward")
            except (KeyError, TypeError, ValueError):
                continue
            if len(rows) == len(f) == len(b) and k not in stages:
                stages[k] = (rows, f, b)
                parts = _split_of(s)
                if parts is not None:
                    split[k] = parts
    if not head and not why:
        if any(isinstance(sh, dict) and sh.get("pp_probe") is True
               for sh in [md, *(md.get("shards") or [])]):
            return Probe(0, 0, 0, {}, NOT_SEEN)
        return None
    try:
        m, r, n = int(head.get("microbatches", 0)), int(head.get("rows", 0)), \
            int(head.get("rounds", 0))
    except (TypeError, ValueError):
        m, r, n = 0, 0, 0
    return Probe(m, r, n, stages, "; ".join(dict.fromkeys(why)), split)


def _split_of(s: dict[str, Any]) -> tuple[float, float] | None:
    """A stage's split backward (input part, weight part), ESTIMATE of the rounds kept;
    None where the probe did not time it."""
    out = []
    for part in ("input", "weight"):
        rounds = s.get(f"{part}_rounds_s")
        if isinstance(rounds, list) and rounds and all(isinstance(x, (int, float))
                                                       for x in rounds):
            out.append(ESTIMATE(np.asarray(rounds, float)))
        elif isinstance(s.get(f"{part}_s"), (int, float)):
            out.append(float(s[f"{part}_s"]))
        else:
            return None
    return (out[0], out[1]) if out[0] >= 0 and out[1] > 0 else None


def split_parts(pr: Probe | None, m: int, n: int) -> tuple[tuple[float, float], ...]:
    """Per stage, from the probe at the recorded microbatch: (the split backward over the
    fused one, the weight part's share of the split one); () where the probe did not time
    every stage's split at this run's microbatch count."""
    if pr is None or pr.microbatches != m or any(k not in pr.split or k not in pr.stages
                                                  for k in range(n)):
        return ()
    out = []
    for k in range(n):
        rows, _, b = pr.stages[k]
        if pr.rows not in rows:
            return ()
        fused = b[rows.index(pr.rows)]
        i, w = pr.split[k]
        if fused <= 0:
            return ()
        out.append(((i + w) / fused, w / (i + w)))
    return tuple(out)


def _of(s: dict[str, Any], part: str) -> tuple[float, ...]:
    """Per size, the stage's `part` (forward, backward): ESTIMATE of its rounds where the
    probe kept them, else the figure it gave."""
    rounds = s.get(f"{part}_rounds_s")
    if isinstance(rounds, list) and rounds and all(isinstance(r, list) and r
                                                   for r in rounds):
        return tuple(ESTIMATE(np.asarray(r, float)) for r in rounds)
    return tuple(float(x) for x in s[f"{part}_s"])


Point = tuple[float, tuple[float, ...], tuple[float, ...], float]


def points(pr: Probe, m: int, fwd: list[float], bwd: list[float], loss: float
           ) -> tuple[tuple[Point, ...], str]:
    """Per probed size, (its microbatch count m r / r', each stage's forward and backward
    and the loss at it), m ascending; or () and why the probe cannot give them."""
    n = len(fwd)
    if not pr.stages:
        return (), pr.why or "no stage was probed"
    if pr.microbatches != m:
        return (), (f"the probe timed the microbatch of {pr.microbatches} microbatches, "
                    f"the analyzed iterations ran {m}")
    missing = [k for k in range(n) if k not in pr.stages]
    if missing:
        return (), (f"stage {', '.join(map(str, missing))} not probed"
                    + (f" ({pr.why})" if pr.why else ""))
    rows = pr.stages[0][0]
    if any(pr.stages[k][0] != rows for k in range(n)) or pr.rows not in rows or len(rows) < 2:
        return (), "the stages were probed at different sizes"
    at = rows.index(pr.rows)
    out = []
    def scaled(k: int, x: float, which: int, j: int) -> float:
        """Stage k's measured `x` times its probe's ratio (forward 1, backward 2) at size j
        to the recorded size."""
        t = pr.stages[k][which]
        return x * t[j] / t[at] if t[at] > 0 else x

    for j, q in enumerate(rows):
        f = tuple(scaled(k, x, 1, j) for k, x in enumerate(fwd))
        b = tuple(scaled(k, x, 2, j) for k, x in enumerate(bwd))
        out.append((m * pr.rows / q, f, b, scaled(n - 1, loss, 1, j)))
    return tuple(sorted(out, key=lambda p: p[0])), ""


def assumption(pr: Probe, recorded_schedule: str = "") -> str:
    rows = next(iter(pr.stages.values()))[0]
    out = ASSUMPTION.format(r=pr.rows, rows=", ".join(map(str, rows)), rounds=pr.rounds)
    if recorded_schedule in OWN_SCALES:
        out += ("; DeepSpeed's pipeline engine's own work per microbatch around the module "
                "(its passes' copies of the activations) scales as its stage's probed compute")
    return out
