"""A windowed recording (`record --steps/--delay/--duration`): what the window held, and the
whole run's per-iteration series (its `run` spans outside the window, its `iteration`
spans inside), with a finding when the iterations outside it differ from those inside."""

from __future__ import annotations

import json
from collections.abc import Collection
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from gputrace.window import PHASES, phase_sums, unpack, window_of
from gputrace.window_pack import RUN_KEYS

if TYPE_CHECKING:
    from gputrace.analyzers.core.frame import Spans

_CATS = ("iteration", "run", *PHASES)
# leave out of the comparison the first iterations (warm-up)
_WARMUP = 3


def _rows(table: pa.Table, rank: int) -> list[dict[str, Any]]:
    m = pc.and_(pc.equal(table["kind"], "span"), pc.equal(table["rank"], rank))
    m = pc.and_(m, pc.is_in(table["cat"].cast(pa.string()), pa.array(_CATS)))
    cols = ["cat", "name", "start_ns", "end_ns", "step", "layer", "args"]
    return table.filter(m).select(cols).to_pylist()


def series(table: pa.Table, rank: int) -> dict[str, Any]:
    """Per iteration of the run on `rank`, in order: step, start/end (ns), whether it was
    inside the window, and its phase sums (ns)."""
    return series_of(_rows(table, rank))


def span_series(sp: Spans) -> dict[str, np.ndarray]:
    """`series` of one rank's spans, as arrays (what its part of the analysis keeps)."""
    codes = [sp.cats.index(c) for c in _CATS if c in sp.cats]
    idx = np.flatnonzero(np.isin(sp.cat, codes))
    cat = [sp.cats[c] for c in sp.cat[idx].tolist()]
    run = [i for i, c in zip(idx.tolist(), cat, strict=True) if c == "run"]
    args = dict(zip(run, sp.args.take(pa.array(run, pa.int64())).to_pylist(), strict=True)) \
        if run else {}
    rows = [{"cat": c, "name": sp.names[n], "start_ns": s, "end_ns": e, "step": st,
             "layer": ly, "args": args.get(i)}
            for i, c, n, s, e, st, ly in zip(
                idx.tolist(), cat, sp.name[idx].tolist(), sp.start[idx].tolist(),
                sp.end[idx].tolist(), sp.step[idx].tolist(), sp.layer[idx].tolist(),
                strict=True)]
    s = series_of(rows)
    return {k: np.asarray(v, bool if k == "inside" else np.int64) for k, v in s.items()}


def series_of(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """`series` of a rank's rows (cat, name, start_ns, end_ns, step, layer, args)."""
    by_step: dict[int, list[tuple[Any, ...]]] = {}
    its = []
    for r in rows:
        if r["cat"] in ("iteration", "run"):
            if r["name"] == "iteration":
                its.append(r)
        elif r["step"] is not None and r["step"] >= 0:
            by_step.setdefault(r["step"], []).append(
                (r["cat"], r["name"], r["start_ns"], r["end_ns"] or r["start_ns"], 0,
                 r["step"], r["layer"] if r["layer"] is not None else -1))
    # (start, end, step, inside, phase sums in ns) per iteration; an iteration in full
    # detail is counted once, where --max-size also kept its `run` entry
    per: list[tuple[int, int, int, bool, dict[str, int]]] = []
    full = {r["step"] for r in its if r["cat"] == "iteration"}
    for r in its:
        if r["cat"] == "iteration":
            per.append((r["start_ns"], r["end_ns"], r["step"], True,
                        phase_sums(by_step.get(r["step"], []))))
        else:
            per.extend((s, e, step, False, sums)
                       for step, s, e, sums in unpack(r["start_ns"], r["end_ns"], r["step"],
                                                      r["args"]) if step not in full)
    per.sort(key=lambda x: x[0])
    out: dict[str, Any] = {"step": [x[2] for x in per], "start": [x[0] for x in per],
                           "end": [x[1] for x in per], "inside": [x[3] for x in per]}
    for p in PHASES:
        out[p] = [int(x[4].get(p, 0)) for x in per]
    return out


def _summary(t: np.ndarray, steps: np.ndarray, inside: np.ndarray) -> dict[str, Any]:
    if not len(t):
        return {}
    order = np.argsort(-t, kind="stable")[:5]
    return {"mean_s": float(t.mean()), "p50_s": float(np.percentile(t, 50)),
            "p95_s": float(np.percentile(t, 95)), "max_s": float(t.max()),
            "slowest": [{"step": int(steps[i]), "t_iter_s": float(t[i]),
                         "inside_window": bool(inside[i])} for i in order]}


def spikes(t: np.ndarray) -> np.ndarray:
    """Indices of iterations well above the run's typical one (past warm-up): more than
    1.5x the median and 6 median absolute deviations above it."""
    if len(t) <= _WARMUP:
        return np.zeros(0, np.int64)
    body = t[_WARMUP:]
    med = float(np.median(body))
    mad = float(np.median(np.abs(body - med)))
    bar = max(1.5 * med, med + 6 * mad)
    idx = np.flatnonzero(t > bar)
    return idx[idx >= _WARMUP]


def analyze_window(table: pa.Table, md: dict[str, Any], rank: int) -> dict[str, Any] | None:
    """`window` and `run` of analyze --json (None: not a windowed recording)."""
    if window_of(md) is None:
        return None
    at = stored_rank(table, rank)
    return window_doc(series(table, at), captured(table, at), md, rank)


def window_doc(s: dict[str, Any], capture: list[dict[str, Any]], md: dict[str, Any],
               rank: int) -> dict[str, Any] | None:
    """`window` and `run` of `rank` from its series (`series`, lists or arrays) and the
    windows `gputrace capture` opened on it (`capture`, as `captured` finds them)."""
    win = window_of(md)
    if win is None:
        return None
    s = {k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in s.items()}
    steps = np.array(s["step"], np.int64)
    t = (np.array(s["end"], np.int64) - np.array(s["start"], np.int64)) / 1e9
    inside = np.array(s["inside"], bool)
    t0 = s["start"][0] if s["start"] else 0
    ins = np.flatnonzero(inside)
    window: dict[str, Any] = {**{k: v for k, v in win.items()
                                 if k not in ("origin_ns", *RUN_KEYS)},
                              "iterations": int(len(ins)),
                              "first_step": int(steps[ins[0]]) if len(ins) else None,
                              "last_step": int(steps[ins[-1]]) if len(ins) else None,
                              "start_s": (s["start"][ins[0]] - t0) / 1e9 if len(ins) else None,
                              "end_s": (s["end"][ins[-1]] - t0) / 1e9 if len(ins) else None,
                              "windows": _windows(s, ins, t0),
                              "captured": capture}
    sp = spikes(t)
    run: dict[str, Any] = {
        "rank": rank, "iterations": int(len(t)), "step": steps.tolist(),
        "t_iter_s": t.tolist(), "inside_window": inside.tolist(),
        "start_s": ((np.array(s["start"], np.int64) - t0) / 1e9).tolist(),
        "phases_s": {p: (np.array(s[p], np.int64) / 1e9).tolist() for p in PHASES},
        "summary": _summary(t, steps, inside),
        "spikes": [{"step": int(steps[i]), "t_iter_s": float(t[i]),
                    "inside_window": bool(inside[i])} for i in sp],
    }
    run["finding"] = _finding(t, steps, inside, sp)
    return {"window": window, "run": run}


def stored_rank(table: pa.Table, rank: int) -> int:
    """The rank `rank`'s rows carry: a job of one process that never said its rank records
    -1, which the analysis calls rank 0."""
    return stored_of(pc.unique(table["rank"]).to_pylist(), rank)


def stored_of(present: Collection[int | None], rank: int) -> int:
    """stored_rank where the ranks the trace's rows carry (`present`) are known."""
    present = set(present)
    return -1 if rank not in present and rank == 0 and -1 in present else rank


def _windows(s: dict[str, Any], ins: np.ndarray, t0: int) -> list[dict[str, Any]]:
    """The runs of consecutive steps recorded in full (one per window opened)."""
    out: list[dict[str, Any]] = []
    for i in ins:
        step = s["step"][i]
        if out and step == out[-1]["last_step"] + 1:
            w = out[-1]
        else:
            w = {"first_step": step, "iterations": 0, "start_s": (s["start"][i] - t0) / 1e9}
            out.append(w)
        w["last_step"], w["end_s"] = step, (s["end"][i] - t0) / 1e9
        w["iterations"] += 1
    return out


def captured(table: pa.Table | None, rank: int) -> list[dict[str, Any]]:
    """The windows `gputrace capture` (or SIGUSR2) opened on `rank`: first step, length,
    and when asked (Unix time, seconds); none where `table` is None."""
    if table is None:
        return []
    m = pc.and_(pc.equal(table["kind"], "instant"), pc.equal(table["cat"], "window"))
    m = pc.and_(m, pc.equal(table["rank"], rank))
    out: dict[tuple[Any, Any], dict[str, Any]] = {}
    for r in table.filter(m).select(["name", "step", "args"]).to_pylist():
        if r["name"] != "capture":
            continue
        try:
            a = json.loads(r["args"] or "{}")
        except ValueError:
            a = {}
        asked = a.get("asked_ns")
        # one window, however many of the rank's processes (its DataLoader workers) noted it
        out.setdefault((r["step"], a.get("count")), {
            "step": r["step"], "count": a.get("count"),
            "asked_unix_s": asked / 1e9 if isinstance(asked, int) else None})
    return sorted(out.values(), key=lambda c: c["step"])


def _finding(t: np.ndarray, steps: np.ndarray, inside: np.ndarray, sp: np.ndarray
             ) -> str | None:
    """The window did not catch the problem: the iterations outside it take longer (or
    shorter) beyond noise, or spike where it did not look."""
    keep = np.arange(len(t)) >= _WARMUP
    tin, tout = t[inside & keep], t[~inside & keep]
    if not len(tin):
        return "no iteration was recorded in full: the window lies outside the run " \
            f"({len(t)} iterations)"
    notes = []
    if len(tout):
        med_in, med_out = float(np.median(tin)), float(np.median(tout))
        q75, q25 = np.percentile(tin, [75, 25])
        noise = max(0.10, 2 * float(q75 - q25) / med_in) if med_in > 0 else 0.10
        if med_in > 0 and abs(med_out / med_in - 1) > noise:
            notes.append(f"the median iteration outside the window takes {med_out * 1e3:.1f} "
                         f"ms, inside it {med_in * 1e3:.1f} ms "
                         f"({med_out / med_in - 1:+.0%}, beyond the window's noise "
                         f"{noise:.0%})")
    # spikes outside the window longer than any iteration it recorded in full
    out_spikes = [i for i in sp if not inside[i] and t[i] > tin.max()]
    if out_spikes:
        worst = sorted(out_spikes, key=lambda i: -t[i])[:3]
        notes.append(f"{len(out_spikes)} iteration(s) outside it spike: " + ", ".join(
            f"{int(steps[i])} ({t[i] * 1e3:.1f} ms)" for i in worst))
    if not notes:
        return None
    return "the window did not catch the problem: " + "; ".join(notes) + \
        "; record those iterations with --steps START:COUNT"


def sparkline(t: np.ndarray, width: int = 60) -> str:
    """The run's iteration time as one line of blocks (each the max of its iterations)."""
    if not len(t):
        return ""
    bars = "▁▂▃▄▅▆▇█"
    chunks = np.array_split(t, min(width, len(t)))
    v = np.array([c.max() for c in chunks])
    lo, hi = float(v.min()), float(v.max())
    if hi <= lo:
        return bars[0] * len(v)
    return "".join(bars[min(7, int((x - lo) / (hi - lo) * 8))] for x in v)
