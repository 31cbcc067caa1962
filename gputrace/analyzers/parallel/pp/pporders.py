"""The order in which each rank of a pipeline runs its actions under a schedule, for any
number of stages per rank: GPipe and 1F1B as pipesim.order writes them; the schedules that
hold several stages per rank (Interleaved1F1B, LoopedBFS, InterleavedZeroBubble,
ZBVZeroBubble, DualPipeV) as torch.distributed.pipelining computes them itself (its
`pipeline_order`, from the schedule's class given stand-in stages: the order is a function
of the ranks, the stages per rank and the microbatches alone), where torch is installed.

Stages are placed as torch places them: looped (rank r holds r, r + p, ...), or V-shaped
for the V schedules (rank r holds r and 2p - 1 - r)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from gputrace.analyzers.parallel.pp import pipesim
from gputrace.analyzers.parallel.pp.pipesim import Action

SINGLE = pipesim.SCHEDULES
V_SHAPED = ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")
SPLIT = ("ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble", "ScheduleDualPipeV")
_ACTION = re.compile(r"(\d+)(F|B|I|W)(\d+)")


@dataclass(frozen=True)
class Layout:
    """Each rank's actions in order, and the rank of each stage."""

    orders: list[list[Action]]
    rank_of: list[int]

    @property
    def stages_per_rank(self) -> int:
        return len(self.rank_of) // max(len(self.orders), 1)


def placement(schedule: str, p: int, v: int) -> list[int]:
    """The rank of each of the p * v stages."""
    if schedule in V_SHAPED:
        return [s if s < p else 2 * p - 1 - s for s in range(2 * p)]
    return [s % p for s in range(p * v)]


def stages_per_rank(schedule: str, v: int) -> int:
    """The stages per rank the schedule runs with (`v` where it takes any)."""
    return 1 if schedule in SINGLE else 2 if schedule in V_SHAPED else v


class _Stand:
    """A stage as torch's schedules read it to order their actions."""

    def __init__(self, index: int, n: int, rank: int, p: int) -> None:
        self.stage_index, self.num_stages = index, n
        self.group_rank, self.group_size = rank, p
        self.is_first, self.is_last = index == 0, index == n - 1
        self.group = self.submod = None
        self.has_backward = True
        self.stage_index_to_group_rank: dict[int, int] = {}


def layout(schedule: str, p: int, v: int, m: int) -> Layout:
    """The schedule's order over p ranks, v stages per rank and m microbatches; ValueError
    where the schedule does not run so (or torch, which orders it, is not installed)."""
    if schedule in SINGLE:
        if v != 1:
            raise ValueError(f"{pipesim.SHORT[schedule]} holds one stage per rank")
        if schedule == "Schedule1F1B" and m < p:
            raise ValueError(f"1F1B needs at least {p} microbatches")
        return Layout([[(k, s, i) for k, i in pipesim.order(schedule, s, p, m)]
                       for s in range(p)], list(range(p)))
    rank_of = placement(schedule, p, v)
    return Layout(_torch_orders(schedule, p, m, rank_of), rank_of)


CACHE, KEEP = "pipeline-orders.json", 64


def _torch_orders(schedule: str, p: int, m: int, rank_of: list[int]) -> list[list[Action]]:
    """Each rank's actions as torch orders them, kept in the cache per torch release:
    importing torch.distributed.pipelining takes seconds (torch, DTensor, dynamo), the
    order it computes is the same every time; a refusal is kept as its message."""
    from importlib.metadata import PackageNotFoundError, version

    from gputrace.cache import read_json, write_json

    short = pipesim.SHORT.get(schedule, schedule)
    try:
        key = f"{version('torch')} {schedule} p{p} m{m} {','.join(map(str, rank_of))}"
    except PackageNotFoundError:
        key = None
    kept = read_json(CACHE) if key else {}
    got = kept.get(key)
    if not (isinstance(got, dict) and ("orders" in got or "error" in got)):
        try:
            got = {"orders": _ordered(schedule, p, m, rank_of)}
        except _Refused as e:
            got = {"error": str(e)}
        if key:   # the last KEEP layouts computed
            kept = {k: v for k, v in read_json(CACHE).items() if k != key}
            write_json(CACHE, dict([*kept.items()][-KEEP + 1:] + [(key, got)]))
    if "error" in got:
        raise ValueError(f"{short} over {p} ranks, {len(rank_of) // max(p, 1)} stages each, "
                         f"{m} microbatches: {got['error']}")
    return [[(str(k), int(s), int(i)) for k, s, i in rank] for rank in got["orders"]]


class _Refused(Exception):
    """The schedule's own refusal of a layout (kept in the cache as its message)."""


def _ordered(schedule: str, p: int, m: int, rank_of: list[int]) -> list[list[Action]]:
    try:
        from torch.distributed.pipelining import schedules
    except Exception as e:  # noqa: BLE001 - torch absent or broken
        raise ValueError(f"{pipesim.SHORT.get(schedule, schedule)}'s order comes from "
                         f"torch.distributed.pipelining, not importable here ({e})") from e
    cls = getattr(schedules, schedule, None)
    if cls is None:
        raise _Refused(f"this torch has no {schedule}")
    orders = []
    for r in range(p):
        mine = [s for s, q in enumerate(rank_of) if q == r]
        try:
            sched = cls([_Stand(s, len(rank_of), r, p) for s in mine], m,
                        loss_fn=lambda out, target: out)
            acts = sched.pipeline_order[r]
        except Exception as e:  # noqa: BLE001 - the schedule's own refusal
            raise _Refused(str(e)) from e
        out: list[Action] = []
        for a in acts:
            if a is not None:
                out += [(k, int(s), int(i)) for s, k, i in _ACTION.findall(str(a))]
        orders.append(out)
    return orders
