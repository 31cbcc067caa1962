"""A pipeline schedule replayed from measured times: each stage runs its actions in the
schedule's order, an action starting when its stage is free and its input has arrived (a
forward: the previous stage's forward of that microbatch, one transfer later; a backward:
the next stage's backward of it, one transfer later, or on the last stage its own forward
and loss). The orders are those torch.distributed.pipelining's schedules run:

- GPipe: every forward, then every backward (microbatches in order);
- 1F1B: min(m, p - s) forwards, then a backward and a forward in turn until the forwards
  are done, then the remaining backwards (Schedule1F1B._step_microbatches).

A transfer between stages starts when both sides are ready (the sender's action done, the
receiver free to post its receive) and then takes its time. What the replay does not model:
the memory each order holds, and a sender held up by a send its receiver has not taken."""

from __future__ import annotations

from dataclasses import dataclass

SCHEDULES = ("ScheduleGPipe", "Schedule1F1B")
SHORT = {"ScheduleGPipe": "GPipe", "Schedule1F1B": "1F1B"}


def order(schedule: str, stage: int, stages: int, m: int) -> list[tuple[str, int]]:
    """A stage's actions, ("F" | "B", microbatch), as the schedule runs them."""
    if schedule == "Schedule1F1B":
        warm = min(m, stages - stage)
        out = [("F", i) for i in range(warm)]
        f, b = warm, 0
        while f < m:
            out += [("B", b), ("F", f)]
            b, f = b + 1, f + 1
        return out + [("B", i) for i in range(b, m)]
    return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]


@dataclass(frozen=True)
class Replay:
    makespan: float                 # first action's start to the last one's end
    busy: list[float]               # per stage, its actions' time
    ends: list[float]               # per stage, when its last action ended

    @property
    def bubble(self) -> list[float]:
        """Per stage, the time in the makespan it ran nothing."""
        return [self.makespan - b for b in self.busy]


def replay(schedule: str, fwd: list[float], bwd: list[float], m: int,
           transfer: float = 0.0, loss: float = 0.0) -> Replay:
    """Replay `schedule` over len(fwd) stages and m microbatches: stage s's forward of a
    microbatch takes fwd[s], its backward bwd[s]; a transfer between stages `transfer`; the
    last stage's loss `loss` after each forward."""
    p = len(fwd)
    orders = [order(schedule, s, p, m) for s in range(p)]
    done: dict[tuple[str, int, int], float] = {}
    nxt = [0] * p
    free = [0.0] * p
    busy = [0.0] * p
    left = sum(len(o) for o in orders)
    while left:
        moved = False
        for s in range(p):
            while nxt[s] < len(orders[s]):
                kind, i = orders[s][nxt[s]]
                if kind == "F":
                    remote = s > 0
                    dep = done.get(("F", s - 1, i)) if remote else 0.0
                    dur = fwd[s] + (loss if s == p - 1 else 0.0)
                else:
                    remote = s < p - 1
                    dep = done.get(("B", s + 1, i)) if remote else done.get(("F", s, i))
                    dur = bwd[s]
                if dep is None:
                    break
                # a transfer starts once both sides are there (the sender done, the
                # receiver free to post its receive): a rendezvous, as gloo's and NCCL's
                # send/recv are
                start = max(free[s], dep) + (transfer if remote else 0.0)
                free[s] = done[(kind, s, i)] = start + dur
                busy[s] += dur
                nxt[s] += 1
                left -= 1
                moved = True
        if not moved:   # an order that waits on itself: not a schedule of these
            raise ValueError(f"{schedule} deadlocks over {p} stages and {m} microbatches")
    return Replay(max(free), busy, free)


def fit_transfer(schedule: str, fwd: list[float], bwd: list[float], m: int, loss: float,
                 measured: float) -> float:
    """The transfer time with which the replay gives the measured makespan (0 when even
    none gives more): what the stages' neighbours cost besides their compute."""
    if replay(schedule, fwd, bwd, m, 0.0, loss).makespan >= measured:
        return 0.0
    lo, hi = 0.0, measured
    for _ in range(50):
        mid = (lo + hi) / 2
        if replay(schedule, fwd, bwd, m, mid, loss).makespan < measured:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def theory(stages: int, m: int) -> float:
    """The bubble's share of the makespan with equal stages and free transfers:
    (p - 1) / (m + p - 1) (GPipe, 1F1B)."""
    return (stages - 1) / (m + stages - 1) if m + stages > 1 else 0.0


def balance(costs: list[float], stages: int) -> list[int]:
    """Cut points splitting layers of the given costs (in order) into `stages` contiguous
    groups with the smallest largest group: the first layer of each group after the
    first."""
    n = len(costs)
    if stages <= 1 or n <= stages:
        return list(range(1, min(n, stages)))
    pre = [0.0]
    for c in costs:
        pre.append(pre[-1] + c)
    inf = float("inf")
    # best[k][i]: the smallest largest group splitting the first i layers into k groups
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                v = max(best[k - 1][j], pre[i] - pre[j])
                if v < best[k][i]:
                    best[k][i], cut[k][i] = v, j
    cuts, i = [], n
    for k in range(stages, 1, -1):
        i = cut[k][i]
        cuts.append(i)
    return sorted(cuts)
