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

SCHEDULES = ("ScheduleGPipe", "Schedule1F1B")     # one stage per rank, ordered here
SHORT = {"ScheduleGPipe": "GPipe", "Schedule1F1B": "1F1B",
         "ScheduleInterleaved1F1B": "Interleaved1F1B", "ScheduleLoopedBFS": "LoopedBFS",
         "ScheduleInterleavedZeroBubble": "InterleavedZeroBubble",
         "ScheduleZBVZeroBubble": "ZBVZeroBubble", "ScheduleDualPipeV": "DualPipeV"}


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


Action = tuple[str, int, int]      # ("F" | "B" | "I" | "W", stage, microbatch)


def replay(schedule: str, fwd: list[float], bwd: list[float], m: int,
           transfer: float = 0.0, loss: float = 0.0) -> Replay:
    """Replay `schedule` (GPipe or 1F1B) over len(fwd) stages, one per rank, and m
    microbatches: stage s's forward of a microbatch takes fwd[s], its backward bwd[s]; a
    transfer between stages `transfer`; the last stage's loss `loss` after each forward."""
    p = len(fwd)
    orders = [[(k, s, i) for k, i in order(schedule, s, p, m)] for s in range(p)]
    return run(orders, list(range(p)), fwd, bwd, [0.0] * p, transfer, loss)


def run(orders: list[list[Action]], rank_of: list[int], fwd: list[float], bwd: list[float],
        weight: list[float], transfer: float = 0.0, loss: float = 0.0) -> Replay:
    """Replay each rank's actions in its order (`orders[r]`, as torch's schedules list
    them): over len(fwd) stages, stage s on rank rank_of[s]; a forward ("F") of stage s
    takes fwd[s] (the last stage's also `loss`), a full backward ("B") bwd[s], the
    backward's input part ("I", zero-bubble schedules) bwd[s] - weight[s] and its weight
    part ("W") weight[s]. A forward waits for the previous stage's forward of its
    microbatch, a backward (or its input part) for the next stage's (the last stage: its own
    forward), a weight part for its input part; `transfer` more where the two stages are on
    two ranks. Busy and bubble per rank."""
    n, p = len(fwd), len(orders)
    done: dict[tuple[str, int, int], float] = {}
    nxt = [0] * p
    free = [0.0] * p
    busy = [0.0] * p
    left = sum(len(o) for o in orders)
    while left:
        moved = False
        for r in range(p):
            while nxt[r] < len(orders[r]):
                kind, s, i = orders[r][nxt[r]]
                if kind == "F":
                    src = s - 1 if s > 0 else None
                    dep = done.get(("F", src, i)) if src is not None else 0.0
                    dur = fwd[s] + (loss if s == n - 1 else 0.0)
                elif kind == "W":
                    src, dep, dur = None, done.get(("B", s, i)), weight[s]
                else:
                    src = s + 1 if s < n - 1 else None
                    dep = done.get(("B", src, i)) if src is not None else \
                        done.get(("F", s, i))
                    dur = bwd[s] - (weight[s] if kind == "I" else 0.0)
                if dep is None:
                    break
                # a transfer starts once both sides are there (the sender done, the
                # receiver free to post its receive): a rendezvous, as gloo's and NCCL's
                # send/recv are
                remote = src is not None and rank_of[src] != r
                start = max(free[r], dep) + (transfer if remote else 0.0)
                free[r] = done[("F" if kind == "F" else "W" if kind == "W" else "B", s, i)] \
                    = start + dur
                busy[r] += dur
                nxt[r] += 1
                left -= 1
                moved = True
        if not moved:   # an order that waits on itself: not a schedule of these
            raise ValueError(f"the order deadlocks over {n} stages")
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


def theory(stages: int, m: int, virtual: int = 1) -> float:
    """The bubble's share of the makespan with equal stages and free transfers, p ranks
    (`stages`) each holding `virtual` stages: (p - 1) / (v m + p - 1) (GPipe, 1F1B: v = 1;
    the interleaved and V schedules: their stages per rank; the zero-bubble ones' own
    splitting of the backward left out: an upper bound for them)."""
    return (stages - 1) / (virtual * m + stages - 1) if virtual * m + stages > 1 else 0.0


def balance(costs: list[float], stages: int, fixed: list[float] | None = None) -> list[int]:
    """Cut points splitting layers of the given costs (in order) into `stages` contiguous
    groups with the smallest largest group (`fixed`: what each stage costs besides its
    layers, whichever it holds): the first layer of each group after the first."""
    fixed = list(fixed or [0.0] * stages)
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
                v = max(best[k - 1][j], pre[i] - pre[j] + fixed[k - 1])
                if v < best[k][i]:
                    best[k][i], cut[k][i] = v, j
    cuts, i = [], n
    for k in range(stages, 1, -1):
        i = cut[k][i]
        cuts.append(i)
    return sorted(cuts)
