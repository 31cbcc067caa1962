"""Replay of a sharded (FSDP) iteration: the forward with each unit's all-gather pipelined
ahead of its compute, the backward with re-gathers ahead of and reduce-scatters behind each
unit's compute, on one comm channel per process group (collectives of a group run one after
another, in issue order). Pure functions of plain numbers (seconds), no trace.

Forward, units k = 1..K in forward order, prefetch depth d (0: issued when the unit needs
it; d: when unit k-d begins computing):
    issue_k = t_k              (d = 0)        begin_{k-d}   (d >= 1)
    start_k = max(issue_k, end_{k-1});  end_k = start_k + a_k
    begin_k = max(t_k, end_k)   exposed_k = begin_k - t_k;  t_{k+1} = begin_k + c_k
Backward, units j = 1..J in backward order: the re-gather g_j ahead of unit j as above, the
reduce-scatter r_j issued when unit j's backward ends, the step waiting for the last one:
    T_b = max(t_end, end of the last reduce-scatter).
A synchronous gather (the issuing thread stands in the call: gloo's on the CPU) holds the
compute where it is issued, prefetched or not: t = max(t, its end)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace


@dataclass(frozen=True)
class Side:
    """One side of one measured iteration: compute between the unit boundaries and the
    service time of each unit's collective on the channel."""

    pre_s: float                          # compute before the first unit needs its params
    compute_s: list[float]                # per unit, after its params are there
    gather_s: list[float | None]          # per unit: all-gather / re-gather (None: none)
    reduce_s: list[float | None] = field(default_factory=list)   # backward: reduce-scatter
    units: list[int] = field(default_factory=list)               # unit index per position
    # backward: the job waited for the reduce-scatter right after issuing it (CPU FSDP, a
    # synchronous reduce): the next unit's compute starts when it ends
    blocking: list[bool] = field(default_factory=list)
    # per position: its gather was synchronous (the issuing thread stood in it, gloo's on the
    # CPU): wherever it is issued, prefetched or not, compute resumes when it ends
    gather_blocking: list[bool] = field(default_factory=list)


@dataclass(frozen=True)
class Timeline:
    """One measured iteration of a sharded run: forward and backward sides and their
    measured durations, and the iteration's measured length."""

    forward: Side
    backward: Side
    forward_s: float
    backward_s: float
    t_iter: float
    # the backward's layers in the order their gradients became ready: (compute before
    # it, from the backward's start, waits for comm left out; gradient bytes)
    layers: tuple[tuple[float, float], ...] = ()


@dataclass(frozen=True)
class Knobs:
    """What a what-if changes: prefetch depths, link speed, collective scale (N GPUs),
    reshard after forward (None: as measured; False: no re-gathers; True: a re-gather of
    each non-root unit ahead of its backward, as long as its forward all-gather). `fixed_s`:
    the part of each collective's service time a faster or slower link leaves as it is (a
    call's own cost, fitted over the run's collectives: sharded._link_cost)."""

    prefetch_forward: int
    prefetch_backward: int
    bandwidth_x: float = 1.0
    scale: float = 1.0                   # service time factor ((N-1)/N over the measured)
    reshard: bool | None = None
    no_comm: bool = False                # one GPU: nothing to gather or reduce
    fixed_s: float = 0.0                 # of each service time, what no link speed changes


@dataclass(frozen=True)
class Result:
    forward_s: float
    backward_s: float
    exposed_forward_s: float
    exposed_backward_s: float     # re-gather waits plus the step's wait for reduce-scatters
    comm_s: float                 # service time on the channel


def _svc(x: float | None, k: Knobs) -> float | None:
    if x is None:
        return None
    if k.no_comm:
        return 0.0
    fixed = min(k.fixed_s, x)
    return (fixed + (x - fixed) / k.bandwidth_x) * k.scale


def run_side(side: Side, depth: int, k: Knobs, gathers: list[float | None] | None = None,
             gather_blocking: list[bool] | None = None) -> tuple[float, float, float, float]:
    """(duration, exposed waiting for gathers, exposed tail waiting for reduces, comm)."""
    gs = [_svc(g, k) for g in (gathers if gathers is not None else side.gather_s)]
    gb = side.gather_blocking if gather_blocking is None else gather_blocking
    held = [bool(gb[j]) if j < len(gb) else False for j in range(len(gs))]
    rs = [_svc(r, k) for r in side.reduce_s] if side.reduce_s else [None] * len(gs)
    n = len(side.compute_s)
    ch = 0.0
    g_end: dict[int, float] = {}
    comm = 0.0

    def put(issue: float, svc: float) -> float:
        nonlocal ch, comm
        ch = max(issue, ch) + svc
        comm += svc
        return ch

    t = side.pre_s
    order = [j for j in range(n) if gs[j] is not None]   # positions that gather
    nth = {j: i for i, j in enumerate(order)}
    exposed = 0.0
    if depth >= 1:   # the first gathers are issued at the side's start
        for j in order[:depth]:
            g_end[j] = put(t if held[j] else 0.0, gs[j])
            if held[j]:
                exposed += g_end[j] - t
                t = g_end[j]
    for j in range(n):
        if gs[j] is not None and j not in g_end:
            g_end[j] = put(t, gs[j])
        ready = max(t, g_end.get(j, t))
        exposed += ready - t
        t = ready
        if depth >= 1 and j in nth and nth[j] + depth < len(order):
            nxt = order[nth[j] + depth]
            if nxt not in g_end:
                g_end[nxt] = put(t, gs[nxt])
                if held[nxt]:     # the thread stands in it before the unit computes
                    exposed += g_end[nxt] - t
                    t = g_end[nxt]
        t += side.compute_s[j]
        if rs[j] is not None:
            put(t, rs[j])
            if side.blocking and side.blocking[j]:
                exposed += max(ch - t, 0.0)
                t = max(t, ch)
    tail = max(ch - t, 0.0) if side.reduce_s else 0.0
    return t + tail, exposed, tail, comm


def simulate(tl: Timeline, k: Knobs, forward_gathers: dict[int, float] | None = None,
             root: int | None = None) -> Result:
    """One iteration replayed under the knobs."""
    bg = tl.backward.gather_s
    bb = list(tl.backward.gather_blocking)
    if k.reshard is False:
        bg = [None] * len(bg)
    elif k.reshard is True and forward_gathers is not None:
        seen: set[int] = set()
        add = []
        # an added re-gather is as synchronous as the forward's gathers were
        fb = bool(tl.forward.gather_blocking) and all(tl.forward.gather_blocking)
        bb = [bool(bb[i]) if i < len(bb) else False for i in range(len(bg))]
        for i, (g, u, r) in enumerate(zip(bg, tl.backward.units,
                                          tl.backward.reduce_s or [None] * len(bg),
                                          strict=True)):
            # a re-gather ahead of the backward of each unit that gathered in forward
            if g is None and r is not None and u not in seen and u in forward_gathers:
                add.append(forward_gathers[u])
                bb[i] = fb
                seen.add(u)
            else:
                add.append(g)
        bg = add
    f, fe, _, fc = run_side(tl.forward, k.prefetch_forward, k)
    b, be, bt, bc = run_side(tl.backward, k.prefetch_backward, k, bg, bb)
    return Result(f, b, fe, be + bt, fc + bc)


def predict(tl: Timeline, k: Knobs, base: Knobs, **kw: object) -> float:
    """The measured iteration plus the replayed change (knobs `k` against `base`, the
    measured configuration replayed)."""
    new = simulate(tl, k, **kw)           # type: ignore[arg-type]
    old = simulate(tl, base, **kw)        # type: ignore[arg-type]
    return tl.t_iter + (new.forward_s + new.backward_s) - (old.forward_s + old.backward_s)


def one_gpu(tl: Timeline, base: Knobs) -> float:
    """The iteration with nothing to gather or reduce."""
    return predict(tl, replace(base, no_comm=True), base)
