"""The measured timeline of a sharded (FSDP) iteration as the replay takes it: per analyzed
iteration, each side's compute between unit boundaries (freed of the job's waits for comm) and
its collectives' service times, and the facts of each collective row."""

from __future__ import annotations

import math

import numpy as np

from gputrace.analyzers.core import collectives as col
from gputrace.analyzers.core import overlap as ov
from gputrace.analyzers.core.steps import RankSteps
from gputrace.analyzers.parallel.sharded import shardsim as sim
from gputrace.analyzers.parallel.sharded.shardinputs import Inputs


def _role(kind: str, role: str, phase: str) -> str:
    if role in col.ROLES:
        return role
    if kind == "all_gather":
        return "reshard_gather" if phase == "backward" else "unshard"
    if kind == "reduce_scatter":
        return "reduce_grad"
    return "hsdp_all_reduce" if kind == "all_reduce" else ""


class Waits:
    """The intervals the job stood still for comm in one iteration, to subtract from the
    compute between unit boundaries."""

    def __init__(self, s: np.ndarray, e: np.ndarray) -> None:
        self.u = ov.union(s, e)

    def inside(self, lo: float, hi: float) -> float:
        if hi <= lo:
            return 0.0
        return float(ov.measure(self.u, np.int64(lo), np.int64(hi)))


def timelines(si: Inputs, rs: RankSteps, sel: np.ndarray, arrive: np.ndarray | None = None,
              held: bool = False) -> tuple[list[sim.Timeline], dict, list[dict[int, float]]]:
    """Per analyzed iteration, the measured sides; per-row facts; forward gather service
    times by unit (for the reshard what-if). `arrive`: per comm row, when the last rank
    arrived at it: a synchronous collective's wait for it is this rank's pace (the slower
    rank's compute), kept as compute in the replay, not as transfer. `held`: a synchronous
    gather holds the compute wherever the replay issues it (Side.gather_blocking)."""
    cr = si.cr
    f_idx = np.flatnonzero(np.array([bool(f) for f in cr.fsdp], bool))
    fwd_lo, fwd_hi, bwd_lo, bwd_hi = si.fwd_lo, si.fwd_hi, si.bwd_lo, si.bwd_hi
    it_of = si.it_of[f_idx]
    start, end = si.start[f_idx], si.end[f_idx]
    roles = [_role(cr.kind[j], cr.role[j], cr.phase[j]) for j in f_idx]
    unit = si.layer[f_idx]
    if (unit < 1).any():   # no unit index: number units by name, in first-gather order
        names: dict[str, int] = {}
        for j in np.argsort(start, kind="stable"):
            nm = cr.unit[f_idx[j]] or ""
            names.setdefault(nm, len(names) + 1)
        unit = np.array([u if u >= 1 else names[cr.unit[f_idx[j]] or ""]
                         for j, u in enumerate(unit.tolist())], np.int64)
    ws, we = cr.wait_s[f_idx], cr.wait_e[f_idx]
    sync = ~cr.is_async[f_idx]
    has_wait = ws >= 0
    blocks = sync & ~has_wait & held
    arr_all = si.start if arrive is None else arrive
    arr = arr_all[f_idx]
    # exposed (reported): from when the rank stood still; in the replay a synchronous call
    # needs its unit's parameters once the last rank is in it
    need0 = np.where(has_wait, ws, np.where(sync, start, end))
    need = np.where(has_wait, ws, np.where(sync, arr, end))
    issue = np.where(sync, arr, start)
    ready = np.where(has_wait, we, end)
    # the intervals the rank stood still for comm: waits, synchronous calls (from the last
    # rank's arrival; before it, the rank waited for a slower peer's compute)
    all_sync = cr.contract & ~cr.is_async & (cr.wait_s < 0)
    ex_s = np.concatenate([cr.wait_s[cr.wait_s >= 0], arr_all[all_sync]])
    ex_e = np.concatenate([cr.wait_e[cr.wait_s >= 0], si.end[all_sync]])
    svc = np.zeros(f_idx.size)
    facts = {"it": it_of, "role": roles, "unit": unit, "start": start, "end": end,
             "exposed": np.maximum(ready - need0, 0), "svc": svc, "rows": f_idx,
             "peer": np.where(sync & ~has_wait, arr - start, 0),
             "beside": np.where(sync & ~has_wait, 0, np.where(has_wait, ws, end) - start)}
    out: list[sim.Timeline] = []
    gathers: list[dict[int, float]] = []
    for k in sel.tolist():
        mine = np.flatnonzero(it_of == k)
        if not mine.size:
            continue
        order = mine[np.argsort(start[mine], kind="stable")]
        ch = -math.inf
        for j in order:   # service on the one channel: from when the channel was free
            svc[j] = (end[j] - max(start[j], ch, arr[j])) / 1e9
            ch = max(ch, end[j])
        waits = Waits(ex_s, ex_e)
        f0, f1 = fwd_lo[k], fwd_hi[k]
        b0, b1 = bwd_lo[k], bwd_hi[k]
        fg = [j for j in order if roles[j] == "unshard"]
        fg.sort(key=lambda j: need[j])
        if f0 < 0:
            f0, f1 = (int(need[fg[0]]), int(ready[fg[-1]])) if fg else (0, 0)
        fwd = _side(fg, need, ready, svc, unit, f0, f1, waits, blocks)
        red = [j for j in order if roles[j] in ("reduce_grad", "hsdp_all_reduce")]
        rgs = [j for j in order if roles[j] == "reshard_gather"]
        if b0 < 0:
            b0 = int(min([need[j] for j in rgs] + [start[j] for j in red] or [0]))
        tail_end = max([b1] + [int(we[j]) for j in red if has_wait[j]])
        # backward positions in measured order: a re-gather opens one (its unit's compute
        # follows it), a reduce-scatter closes one (its unit's backward ended at its issue)
        events = sorted([(int(need[j]), 0, j) for j in rgs] + [(int(issue[j]), 1, j)
                                                               for j in red])
        prev = b0
        comp, gs, rsv, us, blk, gb = [], [], [], [], [], []
        cur_g: float | None = None
        cur_u = -1
        cur_b = False
        for t_ev, is_red, j in events:
            if is_red and comp and rsv[-1] is None and us[-1] == int(unit[j]) and \
                    t_ev <= prev:   # HSDP: the all-reduce right after its reduce-scatter
                rsv[-1] = None
            c = max(t_ev - prev - waits.inside(prev, t_ev), 0) / 1e9
            if not is_red:
                comp.append(c)
                gs.append(cur_g)
                gb.append(cur_b)
                rsv.append(None)
                us.append(cur_u)
                blk.append(False)
                cur_g, cur_u, cur_b = float(svc[j]), int(unit[j]), bool(blocks[j])
                prev = max(prev, int(ready[j]))
            else:
                comp.append(c)
                gs.append(cur_g)
                gb.append(cur_b)
                rsv.append(float(svc[j]))
                us.append(int(unit[j]) if cur_u < 0 else cur_u)
                blk.append(bool(sync[j] or (has_wait[j] and ws[j] - start[j] <= 0.1 * max(
                    end[j] - start[j], 1))))
                cur_g, cur_u, cur_b = None, -1, False
                prev = max(prev, t_ev)
        comp.append(max(tail_end - prev - waits.inside(prev, tail_end), 0) / 1e9)
        gs.append(cur_g)
        gb.append(cur_b)
        rsv.append(None)
        us.append(cur_u)
        blk.append(False)
        bwd = sim.Side(0.0, comp, gs, rsv, us, blk, gb)
        t_iter = float(rs.terms["t_iter"][k])
        lay = np.flatnonzero(si.lay_it == k)
        lay = lay[np.argsort(si.lay_end[lay], kind="stable")]
        layers = tuple((max(int(e) - b0 - waits.inside(b0, int(e)), 0) / 1e9, float(b))
                       for e, b in zip(si.lay_end[lay].tolist(), si.lay_bytes[lay].tolist(),
                                       strict=True) if b0 <= e <= tail_end)
        out.append(sim.Timeline(fwd, bwd, (f1 - f0) / 1e9, (tail_end - b0) / 1e9, t_iter,
                                layers))
        gathers.append({int(unit[j]): float(svc[j]) for j in fg})
    return out, facts, gathers


def _side(gs: list[int], need: np.ndarray, ready: np.ndarray, svc: np.ndarray,
          unit: np.ndarray, lo: int, hi: int, waits: Waits, blocks: np.ndarray) -> sim.Side:
    if not gs:
        return sim.Side(max(hi - lo - waits.inside(lo, hi), 0) / 1e9, [], [], [], [])
    pre = max(int(need[gs[0]]) - lo - waits.inside(lo, int(need[gs[0]])), 0) / 1e9
    comp = []
    last = int(ready[gs[0]])
    for i, j in enumerate(gs):
        r = max(int(ready[j]), last)
        nxt = int(need[gs[i + 1]]) if i + 1 < len(gs) else max(hi, r)
        comp.append(max(nxt - r - waits.inside(r, nxt), 0) / 1e9)
        last = max(r, nxt)
    return sim.Side(pre, comp, [float(svc[j]) for j in gs], [], [int(unit[j]) for j in gs],
                    gather_blocking=[bool(blocks[j]) for j in gs])
