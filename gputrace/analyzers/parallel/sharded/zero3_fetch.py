"""ZeRO-3's parameter fetches replayed under other `stage3_prefetch_bucket_size` and
`stage3_max_live_parameters`. Pure functions of plain numbers.

The run's fetches (the collector's `zero3.fetch` spans: per submodule fetch, in order, its
own parameters as DeepSpeed ids and element counts) are the coordinator's trace. Its rule
(deepspeed.runtime.zero.partitioned_param_coordinator, a complete trace) is followed step by
step: a fetch gathers its submodule's parameters not available, in one call, and waits for
them; it then takes its own parameters off the trace's queue and prefetches, in one call,
the next parameters of the queue not available until min(max_live - available,
prefetch_bucket) elements are taken; when the submodule's compute ends its parameters are
released unless used again within max_reuse_distance elements of the trace or already
prefetched for a later use. Each iteration begins with nothing gathered. The replay then
times it: a call's service is alpha + beta x its bytes (this rank's partitions) on one
channel, in issue order; a fetch's own work (its waits for gathers left out) and the
compute between fetches stay as measured."""

from __future__ import annotations

import json
import math
from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Any

import numpy as np

SPAN = "zero3.fetch"
ASSUMPTIONS = (
    "stage3_prefetch_bucket_size, stage3_max_live_parameters: the recorded fetches are "
    "DeepSpeed's trace; its fetch, prefetch and release rule is replayed on them (a "
    "submodule's parameters released when its own compute ends), each gather one call of "
    "alpha + beta x its bytes on the one channel, a fetch's own work and the compute between "
    "fetches as measured",
)


@dataclass(frozen=True)
class Fetch:
    """One fetch of one iteration."""

    params: tuple[tuple[int, int, bool], ...]   # its submodule's own: (ds_id, numel, persistent)
    busy_s: float        # the fetch's own work, its waits for gathers left out
    after_s: float       # from its end to the next fetch's start (the last one's: 0)
    forward: bool = True


@dataclass(frozen=True)
class Rule:
    prefetch: int        # stage3_prefetch_bucket_size (elements)
    live: int            # stage3_max_live_parameters
    reuse: int           # stage3_max_reuse_distance


def parse(args: str | None) -> tuple[bool, tuple[tuple[int, int, bool], ...]] | None:
    """(forward, params) of a fetch span's args, None when they are not a fetch's."""
    try:
        a = json.loads(args or "")
        return bool(a["forward"]), tuple((int(p[0]), int(p[1]), bool(p[2]))
                                         for p in a["params"])
    except (ValueError, KeyError, TypeError, IndexError):
        return None


def plan(fetches: list[Fetch], rule: Rule) -> list[tuple[list[int], list[int]]]:
    """Per fetch, the parameters (ids) it gathers for its submodule, and those it
    prefetches, under DeepSpeed's rule; each forward and backward pass of the iteration (a
    forward fetch after a backward one begins the next: gradient accumulation) on its own,
    as DeepSpeed resets its trace's queue after each."""
    cuts = [0] + [i for i in range(1, len(fetches))
                  if fetches[i].forward and not fetches[i - 1].forward] + [len(fetches)]
    return [c for lo, hi in zip(cuts, cuts[1:], strict=False)
            for c in _plan_pass(fetches[lo:hi], rule)]


def _plan_pass(fetches: list[Fetch], rule: Rule) -> list[tuple[list[int], list[int]]]:
    numel: dict[int, int] = {}
    avail: set[int] = set()
    for f in fetches:
        for p, n, persist in f.params:
            numel[p] = n
            if persist:
                avail.add(p)    # persistent: gathered once, never released
    persistent = set(avail)
    queue = deque((p, s) for s, f in enumerate(fetches) for p, _, _ in f.params)
    recent: dict[int, float] = defaultdict(lambda: -math.inf)
    live = 0
    out: list[tuple[list[int], list[int]]] = []
    for s, f in enumerate(fetches):
        own = [p for p, _, _ in f.params]
        got = [p for p in own if p not in avail]
        for p in got:
            avail.add(p)
            live += numel[p]
        want = {p for p in own if recent[p] < s}
        taken: set[int] = set()
        while queue and len(taken) < len(want):
            p, last = queue.popleft()
            recent[p] = last
            taken.add(p)
        pre: list[int] = []
        if rule.prefetch > 0:
            budget = min(rule.live - live, rule.prefetch)
            n = 0
            while queue and n < budget:
                p, last = queue.popleft()
                recent[p] = max(recent[p], last)
                if p not in avail and p not in pre:
                    pre.append(p)
                    n += numel[p]
            for p in pre:
                avail.add(p)
                live += numel[p]
        out.append((got, pre))
        step = s + 1       # the coordinator's step once this fetch is done
        free = {p for p in own if p not in persistent and recent[p] <= step}
        seen = 0
        for g in fetches[step:]:
            if seen >= rule.reuse or not free:
                break
            for p, n, _ in g.params:
                free.discard(p)
                seen += n
        for p in free & avail:
            avail.discard(p)
            live -= numel[p]
    return out


def replay(fetches: list[Fetch], calls: list[tuple[list[int], list[int]]], elem: int,
           world: int, alpha: float, beta: float) -> tuple[float, float, float]:
    """(duration from the first fetch's start to the last one's end, waits for gathers,
    comm service) of one iteration's fetches and gathers."""
    numel = {p: n for f in fetches for p, n, _ in f.params}
    ready: dict[int, float] = {}
    t = ch = exposed = comm = 0.0

    def put(ids: list[int]) -> None:
        nonlocal ch, comm
        svc = alpha + beta * sum(-(-numel[p] // world) for p in ids) * elem
        ch = max(ch, t) + svc
        comm += svc
        for p in ids:
            ready[p] = ch

    for f, (got, pre) in zip(fetches, calls, strict=True):
        if got:
            put(got)
        need = max([ready.get(p, t) for p, _, _ in f.params] + [t])
        exposed += need - t
        t = need
        if pre:
            put(pre)
        t += f.busy_s + f.after_s
    return t, exposed, comm


def gathered(calls: list[tuple[list[int], list[int]]]) -> int:
    """Gather calls of one iteration's plan."""
    return sum(bool(g) + bool(p) for g, p in calls)


def elements(fetches: list[Fetch]) -> int:
    """The elements ZeRO-3 gathers for the model's submodules (not persistent), once each."""
    return sum({p: n for f in fetches for p, n, persist in f.params if not persist}.values())


def fetches_of(start: np.ndarray, end: np.ndarray, parsed: list[Any],
               waits: Any) -> list[Fetch]:
    """One iteration's fetches from its spans (ns, in start order; `parsed`: each one's
    (forward, params)), `waits.inside(lo, hi)` the time the job waited for gathers in an
    interval (ns)."""
    out = []
    for i in range(start.size):
        busy = max(int(end[i] - start[i]) - waits.inside(int(start[i]), int(end[i])), 0)
        after = max(int(start[i + 1] - end[i]), 0) if i + 1 < start.size else 0
        out.append(Fetch(parsed[i][1], busy / 1e9, after / 1e9, parsed[i][0]))
    return out
