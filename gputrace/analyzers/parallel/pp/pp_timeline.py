"""A pipeline's iterations as they ran, for the report: every stage's microbatch blocks of
one iteration on one clock (a lane per stage, several per rank under the interleaved and V
schedules), and one pipeline of a pipeline x data-parallel run."""

from __future__ import annotations

from dataclasses import dataclass

from gputrace.analyzers.parallel.pp.pp_model import Pipeline, Stage


def first_replica_of(st: list[Stage]) -> list[Stage]:
    """One pipeline's ranks: for each first stage, its lowest rank."""
    out: dict[int, Stage] = {}
    for s in sorted(st, key=lambda s: (s.stage, s.rank)):
        out.setdefault(s.stage, s)
    return [out[k] for k in sorted(out)]



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
    """One pipeline: each first stage's lowest rank (pipeline x data parallel runs a
    pipeline per replica)."""
    return first_replica_of(pl.stages)


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
                # the rank's step under each of its stages' lanes
                for k in (s.held or (s.stage,)) if b[1] == "step" else (b[5],):
                    blocks.append(Block(k, s.rank, b[1], b[2], max(b[3] - off, 0) / 1e9,
                                        (b[4] - off) / 1e9))
    return Iteration(step, blocks, max(b.end_s for b in blocks))
