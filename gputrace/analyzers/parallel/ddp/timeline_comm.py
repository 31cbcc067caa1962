"""Collectives on the timeline of one iteration: a sharded (FSDP) run's collectives per unit
(the forward all-gathers, the backward re-gathers and reduce-scatters, each split into the
part the job stood still for and the part that ran behind compute), and other collectives
(an MoE all-to-all, a broadcast) per kind.

Under FSDP the data-parallel model's comm units are the same collectives read as gradient
buckets; their lanes are replaced by the units' own."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from gputrace.analyzers.core import collectives as col
from gputrace.analyzers.core.detail import Bar, IterationTimeline
from gputrace.analyzers.core.frame import Spans

# a role's words on the timeline
ROLE_WHAT = {"unshard": "all-gather", "reshard_gather": "re-gather",
             "reduce_grad": "reduce-scatter", "hsdp_all_reduce": "HSDP all-reduce"}


def _role(cr: col.Rows, j: int) -> str:
    r = cr.role[j]
    if r in ROLE_WHAT:
        return r
    if cr.kind[j] == "all_gather":
        return "reshard_gather" if cr.phase[j] == "backward" else "unshard"
    return "reduce_grad" if cr.kind[j] == "reduce_scatter" else "hsdp_all_reduce"


def _parts(s: int, e: int, ws: int, we: int, sync: bool) -> list[tuple[int, int, str]]:
    """(start, end, exposed|hidden) pieces of one collective: its wait is exposed, the rest
    ran behind compute; a synchronous call stood the issuing thread still throughout."""
    if ws >= 0:
        out = [(s, min(ws, e), "hidden"), (max(ws, s), we, "exposed"), (we, e, "hidden")]
        return [p for p in out if p[1] > p[0]] or [(s, max(e, we), "exposed")]
    return [(s, e, "exposed" if sync else "hidden")]


def with_collectives(tl: IterationTimeline, sp: Spans, cr: col.Rows) -> IterationTimeline:
    """The timeline with a lane per FSDP unit (under FSDP, in place of the model's comm
    units) and a lane per kind of other recorded collective."""
    if not cr.n:
        return tl
    sharded = col.is_sharded(cr)
    lo = tl.start_ns
    stop = lo + round(tl.t_iter_s * 1e9)
    s_all, e_all = sp.start[cr.idx], sp.end[cr.idx]
    grad = col.gradient_mask(sp, cr)
    inside = (s_all >= lo) & (s_all < stop) & cr.contract & (sp.device[cr.idx] < 0)
    fsdp = np.array([bool(f) for f in cr.fsdp], bool)
    take = inside & (fsdp | ~grad | col.small_mask(cr))   # a few bytes' all-reduce: no unit
    if not take.any():
        return tl
    bars, lanes = list(tl.bars), list(tl.lanes)
    if sharded:   # the model's comm units are these collectives: drop their lanes
        keep = [ln for ln in lanes if not ln.startswith(("unit ", "units ("))]
        bars = [b for b in bars if b.lane in keep]
        lanes = keep
    unit = sp.layer[cr.idx].astype(int)
    names: dict[int, str] = {}
    new: dict[str, list[Bar]] = {}
    order: dict[str, tuple[int, int]] = {}
    for j in np.flatnonzero(take).tolist():
        s, e = int(s_all[j]), int(e_all[j])
        mb = cr.nbytes[j] / 1e6
        size = "" if np.isnan(mb) else f"{mb:.2f} MB"
        if fsdp[j]:
            u = int(unit[j])
            nm = names.setdefault(u, cr.unit[j] if cr.unit[j] is not None else "")
            lane = f"unit {u}" + (f" {nm}" if nm else " (root)" if cr.unit[j] == "" else "")
            what = ROLE_WHAT[_role(cr, j)]
            order.setdefault(lane, (0, u))
            pre = " (prefetched)" if cr.prefetch[j] else ""
            note = ", ".join(x for x in (f"{cr.kind[j]}{pre}", size,
                                         f"issued in {cr.phase[j]}") if x)
        else:
            lane = f"collective {cr.kind[j]}"
            what = "collective"
            order.setdefault(lane, (1, col.KINDS.index(cr.kind[j])
                                    if cr.kind[j] in col.KINDS else 99))
            note = ", ".join(x for x in (size, f"issued in {cr.phase[j]}") if x)
        sync = bool(cr.contract[j] and not cr.is_async[j])
        for a, b, part in _parts(s, e, int(cr.wait_s[j]), int(cr.wait_e[j]), sync):
            a_s = (min(max(a, lo), stop) - lo) / 1e9
            b_s = (min(max(b, lo), stop) - lo) / 1e9
            new.setdefault(lane, []).append(Bar(lane, f"{what} {part}", a_s, b_s,
                                                part=part, note=note))
    for lane in sorted(new, key=lambda x: order[x]):
        lanes.append(lane)
        bars += new[lane]
    return replace(tl, lanes=lanes, bars=bars)
