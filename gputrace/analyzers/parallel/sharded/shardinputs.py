"""What the sharded (FSDP) analysis reads of one rank's spans, kept small (a row per comm
span and a value per iteration) so that the analysis can run again once every rank's part is
in: then a synchronous collective's wait for the last rank to arrive is known, and the
replay counts it as that rank's pace (compute), not as transfer."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from gputrace.analyzers.core import collective_totals as ct
from gputrace.analyzers.core import collectives as col
from gputrace.analyzers.core import overlap as ov
from gputrace.analyzers.core.frame import Spans
from gputrace.analyzers.core.steps import RankSteps
from gputrace.analyzers.parallel.sharded import zero3_fetch as zf


@dataclass(frozen=True)
class Inputs:
    cr: col.Rows
    start: np.ndarray        # per comm row, ns
    end: np.ndarray
    layer: np.ndarray        # per comm row: the FSDP unit index (-1 unknown)
    it_of: np.ndarray        # per comm row: its iteration, -1 outside any
    fwd_lo: np.ndarray       # per iteration: the host forward's first start / last end, -1
    fwd_hi: np.ndarray
    bwd_lo: np.ndarray
    bwd_hi: np.ndarray
    # the host backward's per-layer spans (a layer's gradients ready at its end): their
    # iteration, end (ns) and gradient bytes (nan unknown); empty when not recorded
    lay_it: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    lay_end: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    lay_bytes: np.ndarray = field(default_factory=lambda: np.zeros(0))
    # ZeRO-3's fetches (analyzers.parallel.sharded.zero3_fetch): iteration, start, end (ns), (forward, params)
    fetch_it: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    fetch_start: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    fetch_end: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    fetch: list = field(default_factory=list)
    # FSDP2's settings as the job set them (args `settings` of its units' collectives): the
    # distinct ones, and per comm row which (-1: none recorded)
    settings: list[dict] = field(default_factory=list)
    settings_of: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))


def window(sp: Spans, cat: str, it_of: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    m = np.flatnonzero(sp.of(cat) & (sp.device < 0) & (it_of >= 0))
    lo = np.full(n, -1, np.int64)
    hi = np.full(n, -1, np.int64)
    big = np.iinfo(np.int64).max
    lo[:] = big
    np.minimum.at(lo, it_of[m], sp.start[m])
    np.maximum.at(hi, it_of[m], sp.end[m])
    lo[lo == big] = -1
    return lo, hi


def iteration_of(rs: RankSteps, t: np.ndarray) -> np.ndarray:
    its = rs.iterations
    k = np.searchsorted(its.start, t, side="right") - 1
    ok = (k >= 0) & (t < its.end[np.clip(k, 0, its.start.size - 1)])
    return np.where(ok, k, -1)


def _settings(sp: Spans, cr: col.Rows) -> tuple[list[dict], np.ndarray]:
    """The settings each FSDP unit's collective carried (each distinct args string read
    once): the distinct (unit, settings), and per comm row its index (-1 none)."""
    code = np.full(cr.n, -1, np.int64)
    out: list[dict] = []
    f = np.flatnonzero(np.array([bool(x) for x in cr.fsdp], bool))
    if not f.size:
        return out, code
    enc = sp.args.take(pa.array(cr.idx[f]))
    if isinstance(enc, pa.ChunkedArray):
        enc = enc.combine_chunks()
    enc = enc.dictionary_encode()
    seen: dict[str, int] = {}
    of = []
    for a in enc.dictionary.to_pylist():
        try:
            v = json.loads(a) if a and '"settings"' in a else {}
        except ValueError:
            v = {}
        st = v.get("settings") if isinstance(v, dict) else None
        if not isinstance(st, dict):
            of.append(-1)
            continue
        key = json.dumps([v.get("unit"), st], sort_keys=True)
        if key not in seen:
            seen[key] = len(out)
            out.append({"unit": v.get("unit") if isinstance(v.get("unit"), str) else "",
                        **st})
        of.append(seen[key])
    idx = enc.indices.fill_null(-1).to_numpy(zero_copy_only=False).astype(np.int64)
    of.append(-1)
    code[f] = np.array(of, np.int64)[idx]
    return out, code


def inputs(sp: Spans, cr: col.Rows, rs: RankSteps) -> Inputs:
    n = rs.iterations.start.size
    it_all = iteration_of(rs, sp.start)
    fl, fh = window(sp, "forward", it_all, n)
    bl, bh = window(sp, "backward", it_all, n)
    lay = np.flatnonzero(sp.of("backward") & (sp.device < 0) & (sp.layer >= 1) &
                         (it_all >= 0))
    fe = np.zeros(0, np.int64)
    got: list = []
    if zf.SPAN in sp.names:
        fe = np.flatnonzero(sp.of("user") & (sp.name == sp.names.index(zf.SPAN)) &
                            (it_all >= 0))
        got = [zf.parse(a) for a in sp.args.take(pa.array(fe)).to_pylist()]
        fe = fe[[g is not None for g in got]]
        got = [g for g in got if g is not None]
    settings, settings_of = _settings(sp, cr)
    return Inputs(cr, sp.start[cr.idx].copy(), sp.end[cr.idx].copy(),
                  sp.layer[cr.idx].astype(np.int64), it_all[cr.idx], fl, fh, bl, bh,
                  it_all[lay], sp.end[lay].copy(), sp.nbytes[lay].astype(float),
                  it_all[fe], sp.start[fe].copy(), sp.end[fe].copy(), got, settings,
                  settings_of)


def summarize_rank(sp: Spans, cr: col.Rows, rs: RankSteps, sel: np.ndarray
                   ) -> ct.Collectives:
    """Per-kind totals of a rank's comm (collectives.summarize with its iterations and
    compute: the phases' own work the hidden and exposed comm is measured against, not the
    outer backward call that waits for DDP's last all-reduces; a GPU's comm records against
    its compute records)."""
    if not cr.n:
        return ct.Collectives()
    compute, device = rs.compute, None
    # a host trace's hidden-vs-exposed comm is measured inside the iterations (a collective
    # that runs past its iteration's end is exposed there only to its end): the kinds' too
    its = rs.iterations
    window = ov.union(its.start[sel], its.end[sel])
    if rs.gpu:   # a host comm span's compute: the host's phases
        compute_m = (sp.of("forward") | sp.of("backward") | sp.of("update") |
                     sp.of("h2d")) & sp.lasting()
        compute, device = ov.union(sp.start[compute_m], sp.end[compute_m]), rs.compute
        window = None     # a GPU's comm records count in their launch's iteration, unclipped
    return ct.summarize(sp, cr, iteration_of(rs, sp.start[cr.idx]), sel, compute, device,
                        window)


def arrivals_of(si: Inputs, unit_start: np.ndarray, unit_arrival: np.ndarray) -> np.ndarray:
    """Per comm row, when the last rank arrived at it (ns, own clock), from the model's comm
    units (under FSDP, the same collectives, matched by their start); its own start where
    not known."""
    out = si.start.copy()
    if not unit_start.size:
        return out
    order = np.argsort(unit_start, kind="stable")
    us = unit_start[order]
    k = np.clip(np.searchsorted(us, si.start), 0, us.size - 1)
    hit = us[k] == si.start
    out[hit] = unit_arrival[order][k[hit]]
    return np.minimum(np.maximum(out, si.start), np.maximum(si.end, si.start))


def small_arrivals(ins: dict[int, Inputs], steps: Mapping[int, RankSteps],
                   arr: dict[int, np.ndarray]) -> None:
    """Into each rank's arrivals (`arr`, per comm row), when the last rank arrived at its
    collectives of a few bytes (no comm unit, so not in the units' arrivals): the same
    iteration's n-th collective of that kind and size on every rank, the latest start (the
    ranks' clocks taken as one: a rank's own start and end bound it)."""
    rows: dict[tuple, list[tuple[int, int]]] = {}
    for r, si in ins.items():
        its = steps[r].iterations.step
        small = np.flatnonzero((si.it_of >= 0) & (si.cr.nbytes > 0) &
                               (si.cr.nbytes < col.SMALL_BYTES) &
                               np.array([not f for f in si.cr.fsdp], bool))
        seen: dict[tuple, int] = {}
        for j in small[np.argsort(si.start[small], kind="stable")].tolist():
            k = (int(its[si.it_of[j]]), si.cr.kind[j], float(si.cr.nbytes[j]))
            n = seen[k] = seen.get(k, -1) + 1
            rows.setdefault((*k, n), []).append((r, j))
    for members in rows.values():
        if len(members) < 2:
            continue
        last = max(int(ins[r].start[j]) for r, j in members)
        for r, j in members:
            arr[r][j] = min(max(last, int(ins[r].start[j])), int(ins[r].end[j]))


def small_calls(si: Inputs, arrive: np.ndarray | None, sel: np.ndarray, kind: str
           ) -> tuple[np.ndarray, np.ndarray]:
    """Service times (s) and bytes of the run's synchronous collectives of a few bytes in the
    analyzed iterations, of `kind` where it has any: the cost of a call."""
    cr = si.cr
    arr = si.start if arrive is None else arrive
    m = (np.array([not f for f in cr.fsdp], bool) & np.isin(si.it_of, sel) & ~cr.is_async
         & (cr.wait_s < 0) & (cr.nbytes > 0) & (cr.nbytes < col.SMALL_BYTES))
    same = m & (np.array(cr.kind) == kind)
    m = same if same.any() else m
    return (si.end[m] - np.maximum(si.start[m], arr[m])) / 1e9, cr.nbytes[m]
