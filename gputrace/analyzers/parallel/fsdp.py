"""Sharded data parallelism (FSDP1, FSDP2, HSDP) as one of the run's dimensions: its
collectives (those FSDP's units issued and, under FSDP, every other data-parallel one;
never tensor, pipeline, expert or context parallelism's), what one rank makes of them
(analyzers.parallel.sharded.sharded: units, exposed per unit, Cases, model, what-ifs replayed on the sharded
timeline) and, across the ranks, the same again knowing when the last rank arrived at each
collective. docs/sharded.md says what it computes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gputrace.analyzers.core import collectives as col
from gputrace.analyzers.parallel.sharded import sharded as shd
from gputrace.analyzers.parallel.sharded.shardinputs import (
    Inputs,
    arrivals_of,
    inputs,
    small_arrivals,
)


@dataclass(frozen=True)
class Part:
    inputs: Inputs            # what the sharded analysis reads, kept small (travels)
    sharded: shd.Sharded
    engine: dict[str, Any] = field(default_factory=dict)   # DeepSpeed's settings


def rank(v: Any) -> Part | None:
    """A rank's sharded analysis (v: registry.RankView), None when FSDP issued nothing."""
    if not col.is_sharded(v.rows):
        return None
    rows = col.subset(v.rows, ~np.array([d in col.PARALLEL for d in v.rows.dim], bool))
    si = inputs(v.sp, rows, v.rs)
    sh = shd.analyze_sharded(si, v.rs, v.sel, v.world, v.link_bytes_per_s, engine=v.engine)
    return None if sh is None else Part(si, sh, v.engine)


def run(parts: dict[int, Part], v: Any) -> dict[int, shd.Sharded] | None:
    """Each rank's sharded analysis again, knowing when the last rank arrived at each of its
    collectives (v: registry.RunView), for the ranks whose arrivals are known."""
    out = {}
    arrs = {r: arrivals_of(p.inputs, v.steps[r].units.start, v.arrivals[r])
            for r, p in parts.items() if r in v.arrivals}
    small_arrivals({r: parts[r].inputs for r in arrs}, v.steps, arrs)
    for r, p in parts.items():
        if r not in v.arrivals:
            continue
        steps = v.steps[r]
        arr = arrs[r]
        sh = shd.analyze_sharded(p.inputs, steps, v.sels[r], v.world, v.link_bytes_per_s,
                                 arrive=arr, engine=p.engine)
        if sh is not None:
            out[r] = sh
    return out or None
