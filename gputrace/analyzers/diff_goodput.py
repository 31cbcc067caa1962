"""Two runs' whole-run time compared: the goodput and each badput category before and after
(analyzers.goodput), the shown rank of each side."""

from __future__ import annotations

from typing import Any

from gputrace.analyzers.goodput import CATEGORIES, WITHHELD
from gputrace.analyzers.results import RankAnalysis


def goodput(b: RankAnalysis, a: RankAnalysis) -> dict[str, Any] | None:
    """Per category (and the training steps, and the wall time) its seconds before and
    after and the change; one value per run, so no noise interval. None where either run
    has no goodput (recorded before it, imported, windowed) or withheld it."""
    gb, ga = b.goodput, a.goodput
    if gb is None or ga is None or WITHHELD in b.withheld or WITHHELD in a.withheld:
        return None

    def row(x: float, y: float, wx: float, wy: float) -> dict[str, Any]:
        return {"before": x, "after": y, "change": y - x,
                "share_before": x / wx if wx > 0 else None,
                "share_after": y / wy if wy > 0 else None}

    cats = {"training": row(gb.training_s, ga.training_s, gb.wall_s, ga.wall_s)}
    cats.update({k: row(gb.badput_s[k], ga.badput_s[k], gb.wall_s, ga.wall_s)
                 for k in CATEGORIES})
    return {"goodput": {"before": gb.goodput, "after": ga.goodput,
                        "change": ga.goodput - gb.goodput},
            "wall_s": {"before": gb.wall_s, "after": ga.wall_s,
                       "change": ga.wall_s - gb.wall_s},
            "categories": cats,
            "evaluation": {"before": dict(gb.evaluation), "after": dict(ga.evaluation)},
            "checkpoint": {"before": dict(gb.checkpoint), "after": dict(ga.checkpoint)}}
