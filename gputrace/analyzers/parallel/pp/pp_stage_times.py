"""Each stage's time per microbatch under another schedule or stage count per rank than the
recorded (the pipeline what-ifs' replay, pp_whatif.predict, takes them): each rank's compute
split over its new stages, the backward split into its input and weight parts or fused
again (by the job's probe where it timed the split, pl.split_probed), each stage's own
work per microbatch added."""

from __future__ import annotations

import numpy as np

from gputrace.analyzers.parallel.pp import pipesim, pporders
from gputrace.analyzers.parallel.pp.pp_model import Pipeline


def under(pl: Pipeline, schedule: str, v: int, f: list[float], b: list[float],
           own: list[tuple[float, float]] | None = None
           ) -> tuple[list[float], list[float], list[float], pporders.Layout | None]:
    """Each stage's forward, backward and weight part under `schedule` at v stages per rank
    (`f`, `b`: the stages' compute per microbatch, their schedule's own work apart): the
    measured stages' where the layout is the recorded one, else each rank's stages'
    compute together split evenly over its new stages; the backward fused or split as
    `schedule` runs it (_split); each stage's own work per microbatch added (`own`,
    default the recorded; its rank's mean over its stages where they change)."""
    own = list(pl.own if own is None else own) or [(0.0, 0.0)] * len(f)
    f2, b2, w2, lay = _split(pl, schedule, v, f, b)
    p = pl.ranks or len(f)
    place = pporders.placement(schedule, p, v)
    was = pporders.placement(pl.schedule, p, pl.stages_per_rank) \
        if pl.schedule in pipesim.SHORT else list(range(len(f)))
    per = own
    if place != was:
        by: dict[int, list[tuple[float, float]]] = {}
        for k, r in enumerate(was):
            by.setdefault(r, []).append(own[k])
        per = [(float(np.mean([x[0] for x in by.get(r, [(0.0, 0.0)])])),
                float(np.mean([x[1] for x in by.get(r, [(0.0, 0.0)])]))) for r in place]
    return ([x + o for x, (o, _) in zip(f2, per, strict=True)],
            [x + o for x, (_, o) in zip(b2, per, strict=True)], w2, lay)


def _split(pl: Pipeline, schedule: str, v: int, f: list[float], b: list[float]
           ) -> tuple[list[float], list[float], list[float], pporders.Layout | None]:
    """Each stage's compute under `schedule` at v stages per rank (see `under`): its forward,
    backward and the backward's weight part. The backward is carried as the fused one
    (the recorded split one over the probe's ratio, pl.split_probed; the first stage's is
    the fused one already) and split again where `schedule` splits it: times the ratio, the
    weight part its share (the recorded share where the recorded schedule split it, else
    the probe's, else half); a first stage's weight part is its whole backward."""
    p = pl.ranks or len(f)
    n = len(b)
    was_split = pl.schedule in pporders.SPLIT
    split = schedule in pporders.SPLIT
    probe = pl.split_probed if len(pl.split_probed) == n else ()
    ratio = [probe[k][0] if probe and k > 0 else 1.0 for k in range(n)]
    recorded = [w / x if x > 0 else 0.0 for w, x in zip(pl.weight or [0.0] * n, b,
                                                         strict=False)]
    share = [recorded[k] if was_split and recorded[k] > 0 else probe[k][1] if probe
             else 0.5 for k in range(n)]
    # each stage's backward as a fused one
    fused = [x / r if was_split else x for x, r in zip(b, ratio, strict=True)]
    place = pporders.placement(schedule, p, v)
    was = pporders.placement(pl.schedule, p, pl.stages_per_rank) \
        if pl.schedule in pipesim.SHORT else list(range(len(f)))
    if place == was:
        if was_split and split:     # the recorded configuration's split, as measured
            return f, b, [x * s for x, s in zip(b, share, strict=True)], None
        f2, b2, rat, sh = f, fused, ratio, share
    else:
        F, B = [0.0] * p, [0.0] * p  # noqa: N806
        R: list[list[float]] = [[] for _ in range(p)]  # noqa: N806
        SH: list[list[float]] = [[] for _ in range(p)]  # noqa: N806
        for k, r in enumerate(was):
            F[r] += f[k]
            B[r] += fused[k]
            # the probe timed every stage's module as one with an upstream neighbour (the
            # first's too): its ratio holds wherever the module goes; the recorded first
            # stage's share (its whole backward) says nothing of a later stage's
            R[r].append(probe[k][0] if probe else 1.0)
            if k > 0 or not was_split:
                SH[r].append(share[k])
        f2 = [F[r] / v for r in place]
        b2 = [B[r] / v for r in place]
        rat = [float(np.mean(R[r])) if R[r] else 1.0 for r in place]
        sh = [float(np.mean(SH[r])) if SH[r] else 0.5 for r in place]
    if not split:
        return list(f2), list(b2), [0.0] * len(b2), None
    # the first stage runs its whole backward as the weight part (torch: its input part
    # is skipped); the others their split one
    b3 = [x if j == 0 else x * r for j, (x, r) in enumerate(zip(b2, rat, strict=True))]
    w3 = [x if j == 0 else x * s for j, (x, s) in enumerate(zip(b3, sh, strict=True))]
    return list(f2), b3, w3, None
