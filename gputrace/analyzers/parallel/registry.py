"""The parallelisms a run shows, each one analyzer module behind one small interface: what
it recognizes in a rank's collectives (classify: each comm span's dimension), what it makes
of one rank (`rank`), what of all of them (`run`: the pipeline's stages, the experts'
imbalance), and the words it adds to the headline. The analysis picks the dimensions a run
shows and combines them; adding one is a module and a line in DIMENSIONS.

FSDP (sharded data parallelism) is one of them (parallel.fsdp over analyzers.parallel.sharded.sharded: its
part replaces the rank's model). Plain data parallelism (DDP's buckets, a job's own gradient
all-reduces) is the paper's model itself (analyzers.core.steps, model, replay) that every run
gets; here it is recognized and named beside the others (its degree, its words)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from gputrace.analyzers.core.collectives import Rows
from gputrace.analyzers.core.frame import Spans
from gputrace.analyzers.core.steps import RankSteps
from gputrace.analyzers.parallel import fsdp, tp
from gputrace.analyzers.parallel.classify import NAMES, by_name
from gputrace.analyzers.parallel.ep import ep
from gputrace.analyzers.parallel.pp import pp


@dataclass(frozen=True)
class RankView:
    """What a dimension reads of one rank."""

    sp: Spans
    rows: Rows
    rs: RankSteps
    sel: np.ndarray
    world: int
    link_bytes_per_s: float | None
    engine: dict[str, Any] = field(default_factory=dict)   # a training engine's settings

    @property
    def it_start(self) -> np.ndarray:
        return self.rs.iterations.start

    @property
    def it_end(self) -> np.ndarray:
        return self.rs.iterations.end

    @property
    def terms(self) -> dict[str, np.ndarray]:
        return self.rs.terms


@dataclass(frozen=True)
class RunView:
    """What a dimension reads across the ranks besides their parts: when the last rank
    arrived at each comm unit (per rank, its own clock), their iterations."""

    world: int
    link_bytes_per_s: float | None
    arrivals: Mapping[int, np.ndarray]   # each rank's unpacked when read
    steps: Mapping[int, RankSteps]   # each rank's unpacked when read (analyzers.run.packed)
    sels: dict[int, np.ndarray]
    calibration: Any = None    # another run of a pipeline (pp_whatif.Calibration)
    offsets: dict[int, int] = field(default_factory=dict)  # ns to subtract: one clock
    pp_probe: Any = None       # a pipeline's stages timed by the job (pp_probed.Probe)


class Dimension(Protocol):
    key: str

    def rank(self, v: RankView) -> Any | None: ...

    def run(self, parts: dict[int, Any], v: RunView) -> Any | None: ...


class _FSDP:
    key = "fsdp"

    def rank(self, v: RankView) -> Any | None:
        return fsdp.rank(v)

    def run(self, parts: dict[int, Any], v: RunView) -> Any | None:
        return fsdp.run(parts, v)


class _TP:
    key = "tp"

    def rank(self, v: RankView) -> Any | None:
        return tp.analyze(v.sp, v.rows, v.it_start, v.it_end, v.sel, v.terms)

    def run(self, parts: dict[int, Any], v: RunView) -> Any | None:
        return None


class _PP:
    key = "pp"

    def rank(self, v: RankView) -> Any | None:
        return pp.analyze(v.sp, v.rows, v.it_start, v.it_end, v.sel, v.terms)

    def run(self, parts: dict[int, Any], v: RunView) -> Any | None:
        return pp.combine(list(parts.values()), calibration=v.calibration, probe=v.pp_probe)


class _EP:
    key = "ep"

    def rank(self, v: RankView) -> Any | None:
        return ep.analyze(v.sp, v.rows, v.it_start, v.it_end, v.sel, v.rs.iterations.step)

    def run(self, parts: dict[int, Any], v: RunView) -> Any | None:
        return ep.imbalance(parts, v.offsets)


DIMENSIONS: tuple[Dimension, ...] = (_FSDP(), _TP(), _PP(), _EP())


def rank_parts(v: RankView) -> dict[str, Any]:
    """Each dimension's part of one rank (those it has)."""
    out = {}
    for d in DIMENSIONS:
        part = d.rank(v)
        if part is not None:
            out[d.key] = part
    return out


def runs(parts: dict[int, dict[str, Any]], v: RunView) -> dict[str, Any]:
    """Each dimension's view across the ranks (those that have one)."""
    out = {}
    for d in DIMENSIONS:
        mine = {r: p[d.key] for r, p in parts.items() if d.key in p}
        if mine:
            got = d.run(mine, v)
            if got is not None:
                out[d.key] = got
    return out


def _told(rows: Rows, inside: np.ndarray | None) -> list[bool]:
    """Which rows tell a dimension: those `inside` (the analyzed iterations, when given:
    not a setup's broadcasts nor an exit barrier), not `other`, and not a gradient
    collective of a few bytes (a loss or a norm reduced on the world group is no
    data-parallel dimension of a tensor-parallel run)."""
    ok = inside.tolist() if inside is not None else [True] * rows.n
    small = rows.small.tolist() if rows.small.size == rows.n else [False] * rows.n
    return [k and not s and d != "other" for d, k, s in zip(rows.dim, ok, small, strict=True)]


def degrees(rows: Rows, inside: np.ndarray | None = None) -> dict[str, int]:
    """Per dimension the rank's collectives show (those that tell one: _told), its group's
    size (0 unknown)."""
    out: dict[str, int] = {}
    # each distinct row once (a repeat changes nothing), in the order of their first
    for d, g, ok in dict.fromkeys(zip(rows.dim, rows.group_size.tolist(),
                                      _told(rows, inside), strict=True)):
        if ok:
            out[d] = max(out.get(d, 0), int(g))
    return out


def groups(rows: Rows, inside: np.ndarray | None = None) -> dict[str, dict[str, Any]]:
    """Per dimension the rank's collectives show (those that tell one: _told), its mesh
    dimension's name ("" none) and the ranks of each of its groups seen (up to 64 ranks a
    group)."""
    out: dict[str, dict[str, Any]] = {}
    # each distinct row once (a repeat changes nothing), in the order of their first
    for d, m, gr, k in dict.fromkeys(zip(rows.dim, rows.mesh_dim or [""] * rows.n,
                                         rows.group_ranks or [None] * rows.n,
                                         _told(rows, inside), strict=True)):
        if not k:
            continue
        # one process group may be two mesh dimensions (torchtitan's fsdp and ep over the
        # same ranks) while the span names one: a name for another dimension is not this
        named = by_name(m) if m else None
        m = m if named is None or named == d or {named, d} <= {"dp", "fsdp"} else ""
        e = out.setdefault(d, {"mesh_dim": m, "ranks": []})
        e["mesh_dim"] = e["mesh_dim"] or m
        if gr is not None and list(gr) not in e["ranks"]:
            e["ranks"].append(list(gr))
    return out


def merge_groups(parts: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """The ranks' groups per dimension as one view of the run."""
    out: dict[str, dict[str, Any]] = {}
    for g in parts:
        for d, e in g.items():
            o = out.setdefault(d, {"mesh_dim": e["mesh_dim"], "ranks": []})
            o["mesh_dim"] = o["mesh_dim"] or e["mesh_dim"]
            o["ranks"] += [r for r in e["ranks"] if r not in o["ranks"]]
    for o in out.values():
        o["ranks"].sort()
    return out


_SHORT = {"dp": "DP", "fsdp": "FSDP", "tp": "TP", "pp": "PP", "ep": "EP", "cp": "CP"}
ORDER = ("fsdp", "dp", "pp", "tp", "cp", "ep")


def describe(deg: dict[str, int], world: int) -> str:
    """The headline's words for a run's dimensions beyond plain data parallelism ("FSDP 2 x
    TP 2, 4 ranks"), "" for none of them."""
    if not set(deg) - {"dp", "fsdp"}:
        return ""
    # one data-parallel replica is no dimension of its own ("PP 2", not "DP 1 x PP 2")
    shown = [d for d in ORDER if d in deg and not (d in ("dp", "fsdp") and deg[d] == 1)]
    # expert (context) parallelism over the data-parallel ranks, as DeepSpeed-MoE and
    # torchtitan lay it out, is not multiplied in: "DP 2 (EP 2 on the same ranks)"
    known = [deg[d] for d in shown if deg[d] > 0]
    inner = [d for d in shown if d in ("ep", "cp") and deg[d] > 0
             and int(np.prod(known)) > world] if known else []
    parts = [f"{_SHORT[d]} {deg[d]}" if deg[d] > 0 else _SHORT[d] for d in shown
             if d not in inner]
    words = " x ".join(parts)
    if inner:
        on = " and ".join(f"{_SHORT[d]} {deg[d]}" for d in inner)
        words = f"{words} ({on} on the same ranks)" if parts else on
    return f"{words}, {world} rank{'s' if world != 1 else ''}"


def beyond_dp(deg: dict[str, int]) -> list[str]:
    """The dimensions the data-parallel model (eq. 1-12, its speedup and bucket what-ifs)
    does not describe."""
    return [d for d in ORDER if d in deg and d not in ("dp", "fsdp")]


def why_no_dp_prediction(deg: dict[str, int]) -> str:
    """Why no data-parallel speedup or bucket what-if is given for such a run."""
    names = " and ".join(NAMES[d] for d in beyond_dp(deg))
    return (f"{names} communication is on the iteration's critical path (activations, not "
            "gradients: no buckets to overlap with the backward), so the data-parallel "
            "speedup and bucket what-ifs do not apply; see the per-dimension what-ifs")
