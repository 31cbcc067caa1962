"""Every analysis checks itself before it speaks. Each invariant below is a relation between
figures of one analysis that holds whenever they are right: the parallel dimensions'
degrees multiply to the world size, each rank's terms sum to its t_iter, no share is over
100 %, a what-if's replay of the measured configuration lands on the measurement, comm is
hidden only under compute, one figure has one value wherever it is printed, and a what-if
that was asked for is a row or a reason. Where one does not hold, one of the figures is
wrong: the figure it touches is withheld, and the reason is given in its place
(`RankAnalysis.withheld`, `Analysis.checks`), in the terminal, `--json`, the API and the
report alike.

`GPUTRACE_STRICT_CHECKS=1` turns a broken consistency invariant of a recorded or imported
trace into an error: the test suite runs so, and a job shape that breaks one fails it."""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gputrace.analyzers.core.results import Analysis, RankAnalysis
    from gputrace.analyzers.parallel.ddp.replay import Scenario

# the invariants, by name, in the words the output gives them
INVARIANTS = {
    "degrees": "the parallel dimensions' degrees multiply to the world size",
    "terms_sum": "each rank's terms (with its exposed comm) sum to its t_iter within 1 %",
    "shares": "no share of an iteration, of comm or of a peak is over 100 %",
    "replay_baseline": "a what-if's replay of the measured configuration lands within 5 % "
                       "of the measured iteration",
    "hidden": "comm is hidden only where compute ran beside it, and hidden plus exposed is "
              "the whole",
    "one_value": "one figure has one value wherever it is printed",
    "what_if_asked": "a what-if asked for is either a row or a line saying why not",
    "goodput_sum": "each rank's training time and badput categories sum to its wall time, "
                   "none of them negative",
}
# consistency invariants: broken, a figure is wrong (a fault of the analysis); of the
# others, a model may miss the run it replays, and a what-if that cannot be replayed gets
# its reason here (the check is what keeps that invariant)
CONSISTENCY = frozenset({"degrees", "terms_sum", "shares", "hidden", "one_value",
                         "goodput_sum"})
TERMS_TOL = 0.01       # the terms' sum against t_iter
TERMS_ABS_S = 20e-6    # and never tighter than this (a clock's tick on tiny iterations)
REPLAY_TOL = 0.05      # the replay of the measured configuration against the measurement
SHARE_TOL = 1e-6
STRICT_ENV = "GPUTRACE_STRICT_CHECKS"


class InvariantBroken(AssertionError):
    """A consistency invariant broke while GPUTRACE_STRICT_CHECKS is set."""


@dataclass(frozen=True)
class Check:
    """An invariant that did not hold: the figure withheld for it, and why."""

    invariant: str
    figure: str
    why: str
    rank: int | None = None

    @property
    def consistency(self) -> bool:
        return self.invariant in CONSISTENCY

    def as_dict(self) -> dict[str, Any]:
        return {"invariant": self.invariant, "figure": self.figure, "why": self.why,
                "rank": self.rank}


def _ms(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if abs(s) < 10 else f"{s:.2f} s"


# -- the parallel dimensions --------------------------------------------------------------

def degrees(deg: Mapping[str, int], world: int, weight: Mapping[str, float] | None = None
            ) -> tuple[dict[str, int], Check | None]:
    """The run's dimensions (dimension -> its group's size, 0 unknown) that can stand
    together on `world` ranks: when the known degrees multiply past the world size, or to a
    number that does not divide it, the dimensions beyond data parallelism are withheld, the
    one with the least evidence (`weight`: e.g. its bytes per iteration) first, until the
    rest fit; with the reason."""
    known = {d: g for d, g in deg.items() if g > 0}
    prod = _product(known)
    if world < 1 or _fits(known, world):
        return dict(deg), None
    words = " x ".join(f"{d.upper()} {g}" for d, g in known.items())
    kept = dict(deg)
    order = sorted((d for d in known if d not in ("dp", "fsdp")),
                   key=lambda d: (weight or {}).get(d, 0.0))
    dropped = []
    for d in order:
        kept.pop(d)
        dropped.append(d)
        if _fits({k: g for k, g in kept.items() if g > 0}, world):
            break
    what = " and ".join(d.upper() for d in dropped) or "the dimensions"
    return kept, Check("degrees", f"the {what} dimension{'s' if len(dropped) > 1 else ''}",
                       f"the degrees read from the collectives' groups ({words}) multiply "
                       f"to {prod}, not to the {world} ranks: the {what} collectives are "
                       "not what they were taken for, so no dimension is claimed for them "
                       "(they stay in the collectives table)")


# expert and context parallelism borrow their ranks from data parallelism (torchtitan's
# ep over dp_shard x cp, an MoE's experts over the data-parallel ranks): not multiplied in,
# each only divides the world
FOLDED = ("ep", "cp")


def _product(known: Mapping[str, int]) -> int:
    return math.prod(g for d, g in known.items() if d not in FOLDED)


def _fits(known: Mapping[str, int], world: int) -> bool:
    prod = _product(known)
    return prod <= world and world % prod == 0 and all(
        world % g == 0 for d, g in known.items() if d in FOLDED)


# -- one rank -----------------------------------------------------------------------------

def _terms_sum(ra: RankAnalysis) -> Check | None:
    b = ra.breakdown
    t_iter = b["t_iter"].mean
    if not t_iter > 0 or ra.analyzed < 1:
        return None
    from gputrace.analyzers.core.steps import PARALLEL_TERMS
    keys = ("t_io", "t_h2d", "t_f", "t_b", "t_u", "t_framework", "t_other", *PARALLEL_TERMS)
    parts = {k: b[k].mean for k in keys if k in b}
    total = sum(parts.values()) + ra.comm.get("exposed_s", 0.0)
    if abs(total - t_iter) <= max(TERMS_TOL * t_iter, TERMS_ABS_S):
        return None
    return Check("terms_sum", "the terms' shares of the iteration",
                 f"the terms and the exposed comm sum to {_ms(total)} per iteration against a "
                 f"measured t_iter of {_ms(t_iter)} ({total / t_iter - 1:+.1%}): some time is "
                 "counted in two terms (or in none), so no term's share is given", ra.rank)


def _shares(ra: RankAnalysis) -> list[Check]:
    out = []
    b = ra.breakdown
    t_iter = b["t_iter"].mean
    over = [k for k, s in b.items() if k != "t_iter" and t_iter > 0
            and s.mean > t_iter * (1 + TERMS_TOL) + TERMS_ABS_S]
    if over:
        out.append(Check("shares", "the terms' shares of the iteration",
                         f"{', '.join(over)} ({', '.join(_ms(b[k].mean) for k in over)}) "
                         f"exceed the iteration's {_ms(t_iter)}", ra.rank))
    for name, d in (("comm", ra.comm), ("io", ra.io)):
        f = d.get("hidden_fraction", 0.0)
        if f == f and not -SHARE_TOL <= f <= 1 + SHARE_TOL:
            out.append(Check("shares", f"the hidden share of {name}",
                             f"{f:.0%} of it is counted hidden", ra.rank))
    return out


def _hidden(ra: RankAnalysis) -> list[Check]:
    out = []
    compute = sum(ra.breakdown[k].mean for k in ("t_h2d", "t_f", "t_b", "t_u")
                  if k in ra.breakdown)
    for name, d in (("comm", ra.comm), ("io", ra.io)):
        tot, hid, exp = (d.get(k, 0.0) for k in ("total_s", "hidden_s", "exposed_s"))
        tol = max(1e-3 * tot, TERMS_ABS_S)
        if hid < -tol or exp < -tol or abs(hid + exp - tot) > tol:
            out.append(Check("hidden", f"the hidden and exposed {name}",
                             f"hidden {_ms(hid)} and exposed {_ms(exp)} do not make the "
                             f"total {_ms(tot)}", ra.rank))
        elif name == "comm" and hid > tol and compute <= 0:
            out.append(Check("hidden", "the hidden and exposed comm",
                             f"{_ms(hid)} of comm is counted hidden while no compute was "
                             "measured beside it", ra.rank))
    return out


def _kinds_agree(ra: RankAnalysis) -> Check | None:
    kinds = ra.collectives.kinds
    if not kinds or ra.sharded is not None or ra.comm.get("total_s", 0.0) <= 0:
        return None
    # the hidden-vs-exposed comm is the data-parallel model's: a model-parallel kind's
    # exposed time (pipeline send/recv of PP x DP) is its dimension's term, not in it
    by_kinds = ra.collectives.exposed_s   # each instant once, over the kinds
    exposed = ra.comm.get("exposed_s", 0.0)
    if abs(by_kinds - exposed) <= max(0.01 * max(exposed, by_kinds), 1e-4):
        return None
    return Check("one_value", "the collectives' exposed time by kind",
                 f"the kinds' exposed times add up to {_ms(by_kinds)} per iteration, the "
                 f"hidden-vs-exposed comm gives {_ms(exposed)}", ra.rank)


def _speedup_point(ra: RankAnalysis, world: int) -> tuple[Any, Check | None]:
    """The speedup table's point at the measured GPU count, which must be eq.'s prediction
    of the measured iteration (one figure, one value); withheld when it is not."""
    sp, m = ra.speedup, ra.model
    pts = list(sp.points)
    for i, p in enumerate(pts):
        if p.gpus != world or p.withheld or world < 2 or not m.predicted_t_iter > 0:
            continue
        # the model's prediction of the run, or the run itself where the table is anchored
        # on it (the sharded replay's: measured plus the change it replays)
        if any(abs(p.t_iter - x) <= 0.01 * x for x in (m.predicted_t_iter,
                                                       m.measured_t_iter) if x > 0):
            return sp, None
        why = (f"its t_iter at the measured {world} GPUs, {_ms(p.t_iter)}, is neither eq. "
               f"{m.equation}'s {_ms(m.predicted_t_iter)} for the same run nor the measured "
               f"{_ms(m.measured_t_iter)}")
        pts[i] = replace(p, speedup=math.nan, efficiency=math.nan, t_iter=math.nan,
                         t_comm=math.nan, withheld=why)
        return replace(sp, points=pts), Check("one_value", f"the speedup at {world} GPUs",
                                              why, ra.rank)
    return sp, None


def _goodput_sum(ra: RankAnalysis) -> Check | None:
    """The run's time: training and every badput category make its wall time."""
    g = ra.goodput
    if g is None:
        return None
    parts = [g.training_s, *g.badput_s.values()]
    total = sum(parts)
    if abs(total - g.wall_s) <= max(1e-6 * g.wall_s, TERMS_ABS_S) and min(parts) >= 0:
        return None
    from gputrace.analyzers.extras.goodput import WITHHELD
    return Check("goodput_sum", WITHHELD,
                 f"training ({_ms(g.training_s)}) and the badput categories sum to "
                 f"{_ms(total)} against the run's wall time of {_ms(g.wall_s)}: some time is "
                 "counted twice or not at all", ra.rank)


def _window_empty(ra: RankAnalysis) -> Check | None:
    """A window that holds no training iteration: the analysis took the whole trace as one
    'iteration', which is none of the job's steps (their times, outside the window, are
    the goodput's)."""
    g = ra.goodput
    if not ra.synthetic_iterations or g is None:
        return None
    return Check("iterations_in_window", "the per-iteration figures",
                 f"no training iteration in the recorded window: the run's {g.iterations} "
                 "training steps all lie outside it (their times only); the whole trace as "
                 "one window is none of them", ra.rank)


def _replay_baseline(ra: RankAnalysis) -> Check | None:
    rp = ra.replay
    if rp is None or not rp.measured_t_iter > 0:
        return None
    if abs(rp.baseline_error) <= REPLAY_TOL:
        return None
    return Check("replay_baseline", "the what-if replay",
                 f"replaying the measured configuration gives {_ms(rp.baseline_t_iter)} "
                 f"against the measured {_ms(rp.measured_t_iter)} "
                 f"({rp.baseline_error:+.1%}, over {REPLAY_TOL:.0%}): the replay does not "
                 "reproduce this run, so its predictions are not given", ra.rank)


def _asked(ra: RankAnalysis, asked: Sequence[Scenario], world: int) -> list[Check]:
    """A what-if asked for that has no row: the reason (the replay's own where there is no
    replay at all)."""
    if not asked or ra.sharded is not None or ra.dims:
        return []
    rp = ra.replay
    if rp is None:
        why = ra.replay_unavailable or "no what-if replay for this run"
        return [Check("what_if_asked", f"what-if {s.label}", why, ra.rank) for s in asked]
    have = {o.scenario for o in rp.outcomes}
    ref = world if world > 1 else 2
    out = []
    for s in asked:
        full = replace(s, gpus=s.gpus or ref)
        if full in have:
            continue
        why = ("bucket sizes are not replayed: the trace has no per-layer gradient bytes "
               "and ready times" if s.bucket_bytes is not None and not rp.layers_known
               else "not among the replayed scenarios")
        out.append(Check("what_if_asked", f"what-if {full.label}", why, ra.rank))
    return out


def check_rank(ra: RankAnalysis, world: int, asked: Sequence[Scenario] = ()
               ) -> tuple[RankAnalysis, list[Check]]:
    """One rank's figures checked: the rank with what broke an invariant withheld (and the
    reasons in its `withheld`), and the checks that failed."""
    checks: list[Check] = []
    c = _terms_sum(ra)
    checks += [c] if c else []
    checks += _shares(ra)
    checks += _hidden(ra)
    c = _kinds_agree(ra)
    checks += [c] if c else []
    c = _goodput_sum(ra)
    checks += [c] if c else []
    c = _window_empty(ra)
    checks += [c] if c else []
    sp, c = _speedup_point(ra, world)
    checks += [c] if c else []
    c = _replay_baseline(ra)
    replay, why_no = ra.replay, ra.replay_unavailable
    if c is not None:
        checks.append(c)
        replay, why_no = None, c.why
    checks += _asked(replace(ra, replay=replay, replay_unavailable=why_no), asked, world)
    if not checks:
        return ra, []
    withheld = dict(ra.withheld)
    for k in checks:
        withheld.setdefault(k.figure, k.why)
    return replace(ra, speedup=sp, replay=replay, replay_unavailable=why_no,
                   withheld=withheld), checks


def check(a: Analysis, asked: Sequence[Scenario] = (), before: Iterable[Check] = ()
          ) -> Analysis:
    """The analysis with every rank checked (`before`: checks made while it was built, the
    degrees'), its figures that broke an invariant withheld, `checks` listing them; raises
    InvariantBroken for a consistency invariant under GPUTRACE_STRICT_CHECKS."""
    checks = list(before)
    ranks = {}
    for r, ra in a.ranks.items():
        ranks[r], cs = check_rank(ra, a.world_size, asked)
        checks += cs
    out = replace(a, ranks=ranks, checks=checks)
    strict(checks, a.metadata)
    return out


def strict(checks: Iterable[Check], md: Mapping[str, Any] | None = None) -> None:
    """Under GPUTRACE_STRICT_CHECKS, a broken consistency invariant of a recorded trace (a
    job's, recorded by gputrace, or another tool's, imported: metadata `collectors` or
    `imported` not empty; not a trace built by hand for a test, nor several of them read as
    one) is an error."""
    if os.environ.get(STRICT_ENV, "") in ("", "0"):
        return
    if md is not None and not (md.get("collectors") or md.get("imported")):
        return
    broken = [c for c in checks if c.consistency]
    if broken:
        raise InvariantBroken("; ".join(
            f"{c.invariant} (rank {c.rank}): {c.figure}: {c.why}" for c in broken))


def share_ok(x: float | None) -> bool:
    """A share (of a peak, of a whole) that may be printed: not over 100 %."""
    return x is None or x != x or x <= 1 + SHARE_TOL
