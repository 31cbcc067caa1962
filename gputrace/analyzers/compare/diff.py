"""Two analyses compared: each term's change with a 95 % interval from bootstrap resampling of
each run's analyzed iterations, and what matched (layers, comm units, collectives, ranks,
kernels) side by side. A pure function of the two analyses and their per-name totals."""

from __future__ import annotations

from typing import Any

import numpy as np

from gputrace.analyzers import Analysis, RankAnalysis
from gputrace.analyzers.compare import diff_goodput
from gputrace.analyzers.compare.diff_noise import (  # noqa: F401 (interval: here too)
    METHOD,
    RESAMPLES,
    RUNS_FOR_DRIFT,
    SEED,
    Noise,
    interval,
    iteration_excursions,
    net_of_wait,
    put_interval,
)
from gputrace.analyzers.compare.diff_parts import Parts

TOP = 10
# the breakdown's terms as the terminal report shows them, exposed comm beside all comm
TERMS = (("t_iter", "iteration"), ("t_io", "waiting for data (I/O)"),
         ("t_h2d", "host to device copies"), ("t_f", "forward"), ("t_b", "backward"),
         ("t_u", "update (optimizer)"), ("t_comm", "comm (all of it)"),
         ("comm_exposed", "exposed comm"), ("t_tp", "tensor-parallel comm"),
         ("t_pp", "pipeline bubble"), ("t_ep", "expert-parallel comm"),
         ("t_cp", "context-parallel comm"), ("t_framework", "framework"),
         ("t_other", "in no phase"))
# the terms an iteration is made of, whose stalls its own spread can hide
LEAVES = ("t_io", "t_h2d", "t_f", "t_b", "t_u", "comm_exposed", "t_other", "t_framework",
          "t_tp", "t_pp", "t_ep", "t_cp")
# what a run's metadata says of how it was made (the rest differs from run to run anyway)
MADE = ("world_size", "hosts", "cpus", "argv", "software", "env", "sample_hz", "collectors",
        "imported")


def series(ra: RankAnalysis) -> dict[str, np.ndarray]:
    """A rank's analyzed iterations, per term (empty without the analysis's detail)."""
    d = ra.detail
    if d is None:
        return {}
    s = d.series
    k = s.kept
    out = {name: np.asarray(v, float)[k] for name, v in s.terms.items()}
    out["comm_exposed"] = np.asarray(s.comm_exposed_s, float)[k]
    if ra.sharded is not None:     # FSDP's exposed comm is its units' own, per iteration
        out["comm_exposed"] = np.asarray(ra.sharded.exposed_series, float)
    return out


def change(before: float, after: float, ci: Noise | None) -> dict[str, Any]:
    d = after - before
    beyond = ci is not None and (ci.low > 0 or ci.high < 0)
    return {"before": before, "after": after, "change": d,
            "change_pct": d / before * 100 if before else None,
            "low": ci.low if ci else None, "high": ci.high if ci else None,
            "beyond_noise": bool(beyond), "between_s": ci.between_s if ci else None}


def _mean(ra: RankAnalysis, k: str) -> float | None:
    if k == "comm_exposed":
        return float(ra.comm["exposed_s"])
    s = ra.breakdown.get(k)
    return None if s is None else float(s.mean)


def breakdown(b: RankAnalysis, a: RankAnalysis, wait_b: float | None = None,
              wait_a: float | None = None) -> dict[str, dict[str, Any]]:
    """Each term's change; `wait_b`, `wait_a`: each run's run-queue wait per iteration
    (None where not recorded), that `t_iter`'s interval holds the change net of too."""
    sb, sa = series(b), series(a)
    ex = [iteration_excursions(s, LEAVES) if "t_iter" in s else None for s in (sb, sa)]
    out: dict[str, dict[str, Any]] = {}
    for k, label in TERMS:
        mb_, ma = _mean(b, k), _mean(a, k)
        if mb_ is None and ma is None:
            continue
        if mb_ is None or ma is None:   # a term one run's analysis has no row for: 0 there
            mb_, ma = mb_ or 0.0, ma or 0.0
        if k != "t_iter" and mb_ == 0 and ma == 0:
            continue
        ci = None
        if k in sb and k in sa:
            ci = interval(sb[k], sa[k])
            if k == "t_iter" and wait_b is not None and wait_a is not None:  # the load, measured
                ci = net_of_wait(interval(sb[k], sa[k], ex_x=np.zeros(0), ex_y=np.zeros(0)),
                                 mb_, ma, wait_b, wait_a)
            elif k == "t_iter":
                ci = interval(sb[k], sa[k], ex_x=ex[0], ex_y=ex[1])
        out[k] = {"label": label, **change(mb_, ma, ci)}
    return out


def terms_only(terms: dict[str, dict[str, Any]]) -> dict[str, list[str]]:
    """The terms one run has time in and the other none (`before`, `after`): what one
    side measured and the other did not (an import without phases of some kind, a job
    without comm), or a part the change removed or added."""
    return {side: [k for k, v in terms.items() if k != "t_iter" and v[side] and not v[other]]
            for side, other in (("before", "after"), ("after", "before"))}


def headline(terms: dict[str, dict[str, Any]]) -> dict[str, Any]:
    t = terms["t_iter"]
    explain = [{"term": k, "label": v["label"], "change": v["change"]}
               for k, v in terms.items()
               if k not in ("t_iter", "t_comm") and v["beyond_noise"]]
    explain.sort(key=lambda e: -abs(e["change"]))
    verdict = "no interval" if t["low"] is None else "within noise" \
        if not t["beyond_noise"] else "faster" if t["change"] < 0 else "slower"
    return {**t, "verdict": verdict, "explained_by": explain}


def _top(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows.sort(key=lambda r: -abs(r["change"]))
    return rows[:TOP]


Series = dict[str, np.ndarray]


def named(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]],
          key: str = "time_s", series_before: Series | None = None,
          series_after: Series | None = None) -> dict[str, Any]:
    """Rows matched by name: the top changes of `key`, and the names on one side only. With
    each name's per-iteration figures (whose mean is `key`), a top row's change gets its
    95 % interval (`low`, `high`, `beyond_noise`; null and false without them)."""
    both = [{"name": n, **{f"{f}_before": before[n][f] for f in before[n]},
             **{f"{f}_after": after[n][f] for f in after[n]},
             "change": after[n][key] - before[n][key]} for n in before if n in after]
    top = _top(both)
    for r in top:
        xb, xa = (None if s is None else s.get(r["name"])
                  for s in (series_before, series_after))
        put_interval(r, interval(xb, xa) if xb is not None and xa is not None else None)
    return {"matched": len(both), "top": top,
            "only_before": sorted(n for n in before if n not in after),
            "only_after": sorted(n for n in after if n not in before)}


def unit_rows(ra: RankAnalysis) -> tuple[dict[str, dict[str, float]], Series]:
    """A rank's comm units by name, and each DDP unit's duration per iteration."""
    if ra.sharded is not None:     # FSDP units' figures are their own: no series
        return {f"{u.name or u.unit} {u.role}": {
            "time_s": u.duration_s, "exposed_s": u.exposed_s, "bytes": u.nbytes,
            "count": u.count} for u in ra.sharded.units}, {}
    out, per = {}, {}
    durations = ra.detail.unit_durations if ra.detail is not None else {}
    for u in ra.model.units:
        name = ("layers " + ",".join(map(str, u.layers))) if u.layers else f"unit {u.index}"
        out[name] = {"time_s": u.duration_s, "hidden": float(u.hidden),
                     "bytes": float(u.nbytes) if u.nbytes == u.nbytes else None}
        if u.index in durations:
            per[name] = durations[u.index]
    return out, per


def units_match(b: RankAnalysis, a: RankAnalysis, d: dict[str, Any]) -> bool:
    """The same units on both sides (FSDP: the same unit names, whatever their roles)."""
    if b.sharded is not None and a.sharded is not None:
        names = [{u.name or str(u.unit) for u in x.sharded.units} for x in (b, a)]
        return names[0] == names[1]
    return not d["only_before"] and not d["only_after"]


def units(b: RankAnalysis, a: RankAnalysis) -> dict[str, Any]:
    """Comm units (DDP buckets, FSDP units) matched by their unit names or their layers,
    by position only where neither is known. An FSDP unit has a row per role of its
    collectives ("blocks.0 reshard_gather": the backward's re-gather), with their count per
    iteration: a role that one run has and the other not (reshard_after_forward off) is a
    row on one side only, its unit still matched (`units_match`)."""
    (kb, sb), (ka, sa) = unit_rows(b), unit_rows(a)
    out = named(kb, ka, series_before=sb, series_after=sa)  # type: ignore[arg-type]
    out["units_match"] = units_match(b, a, out)
    return out


def kind_rows(ra: RankAnalysis) -> dict[str, dict[str, float]]:
    """A rank's collectives per kind: time, count and bytes."""
    out: dict[str, dict[str, float]] = {}
    for k in ra.collectives.kinds:
        d = out.setdefault(k.kind, {"time_s": 0.0, "count": 0.0, "bytes": 0.0})
        d["time_s"] += k.time_s
        d["count"] += k.count
        d["bytes"] += k.nbytes
    return out


def collectives(b: RankAnalysis, a: RankAnalysis) -> dict[str, Any]:
    return named(kind_rows(b), kind_rows(a))


def rank_rows(x: Analysis) -> dict[str, dict[str, float]]:
    """Each rank's mean iteration."""
    return {str(r): {"time_s": ra.breakdown["t_iter"].mean} for r, ra in x.ranks.items()}


def ranks(b: Analysis, a: Analysis) -> dict[str, Any]:
    t = rank_rows
    sb, sa = {o.rank for o in b.outliers}, {o.rank for o in a.outliers}
    return {"slowest_before": b.slowest_rank, "slowest_after": a.slowest_rank,
            "stragglers_before": sorted(sb), "stragglers_after": sorted(sa),
            "stragglers_appeared": sorted(sa - sb), "stragglers_gone": sorted(sb - sa),
            **named(t(b), t(a))}


def model(ra: RankAnalysis) -> dict[str, Any]:
    m, sp = ra.model, ra.speedup
    return {"strategy": m.strategy, "case": m.case, "predicted_t_iter": m.predicted_t_iter,
            "measured_t_iter": m.measured_t_iter,
            "speedup": {str(p.gpus): None if p.withheld or p.speedup != p.speedup
                        else float(p.speedup) for p in sp.points}}


def made(b: Analysis, a: Analysis) -> dict[str, Any]:
    """How the runs were made, where they differ."""
    out: dict[str, Any] = {}
    mb_, ma = b.metadata, a.metadata
    for k in MADE:
        vb, va = mb_.get(k), ma.get(k)
        if k == "world_size":
            vb, va = b.world_size, a.world_size
        if k == "hosts":
            vb, va = sorted({r.host for r in b.ranks.values()}), \
                sorted({r.host for r in a.ranks.values()})
        if k == "collectors":   # what each collector did (its pids differ in every run)
            vb, va = ({n: c.get("status") if isinstance(c, dict) else c
                       for n, c in (v or {}).items()} for v in (vb, va))
        if k == "imported":     # the tool and file each import was made from
            vb, va = ([f"{s.get('tool', '?')} {s.get('path', '?')}" for s in v
                       if isinstance(s, dict)] if isinstance(v, list) else v
                      for v in (vb, va))
        if vb == va:
            continue
        if isinstance(vb, dict) and isinstance(va, dict):
            out[k] = {n: [vb.get(n), va.get(n)] for n in sorted({*vb, *va})
                      if vb.get(n) != va.get(n)}
        else:
            out[k] = [vb, va]
    return out


def noise(b: RankAnalysis, a: RankAnalysis, pb: Parts, pa: Parts) -> dict[str, Any]:
    """How the intervals are made, each run's excursions per iteration (the time of its
    iterations above their fence: the between-run term of `t_iter`'s interval), its
    run-queue wait per iteration behind other processes (the load) and behind its own (not
    noise), and that with one run a side the drift between runs is not in the interval."""
    ex = {side: float(np.mean(iteration_excursions(s, LEAVES))) if s.get("t_iter") is not None
          and s["t_iter"].size else None for side, s in (("before", series(b)),
                                                         ("after", series(a)))}
    waited = pb.run_wait_s is not None and pa.run_wait_s is not None
    return {"method": METHOD + ("+run_wait" if waited else ""), "resamples": RESAMPLES, "confidence": 0.95, "excursions_s": ex,
            "run_wait_s": {"before": pb.run_wait_s, "after": pa.run_wait_s},
            "run_wait_own_s": {"before": pb.own_wait_s, "after": pa.own_wait_s},
            "runs": {"before": 1, "after": 1}, "drift_in_interval": False,
            "runs_for_drift": RUNS_FOR_DRIFT}


def compare(b: Analysis, a: Analysis, rank_b: int, rank_a: int, pb: Parts, pa: Parts
            ) -> dict[str, Any]:
    """The diff document of two analyses (the rank each shows) and their per-name parts."""
    rb, ra = b.ranks[rank_b], a.ranks[rank_a]
    terms = breakdown(rb, ra, pb.run_wait_s, pa.run_wait_s)
    layers = {ph: named(getattr(pb, ph), getattr(pa, ph), series_before=pb.series.get(ph),
                        series_after=pa.series.get(ph)) for ph in ("forward", "backward")}
    unit = units(rb, ra)
    why = []
    for what, d in (("layers", layers["backward"]), ("comm units", unit)):
        if (d["only_before"] or d["only_after"]) and d.get("units_match") is not True:
            why.append(f"{what} do not match ({len(d['only_before'])} only before, "
                       f"{len(d['only_after'])} only after, {d['matched']} in both)")
    return {"headline": headline(terms), "breakdown": terms, "terms_only": terms_only(terms),
            "noise": noise(rb, ra, pb, pa),
            "comparable": not why, "not_comparable": "; ".join(why) or None,
            "rank_before": rank_b, "rank_after": rank_a,
            "iterations": {"before": rb.iterations - rb.warmup_skipped,
                           "after": ra.iterations - ra.warmup_skipped},
            "layers": layers, "units": unit, "collectives": collectives(rb, ra),
            "ranks": ranks(b, a), "kernels": named(pb.kernels, pa.kernels, series_before=pb.series.get("kernels"),
                             series_after=pa.series.get("kernels")),
            "model": {"before": model(rb), "after": model(ra)}, "made": made(b, a),
            "throughput": throughput(b, a), "goodput": diff_goodput.goodput(rb, ra)}


def throughput(b: Analysis, a: Analysis) -> dict[str, Any] | None:
    """The job's samples (tokens) per second before and after, where both runs tell their
    batch (None otherwise)."""
    tb, ta = b.throughput, a.throughput
    if tb is None or ta is None:
        return None
    out = {"samples_per_s": {"before": tb.samples_per_s, "after": ta.samples_per_s,
                             "ratio": ta.samples_per_s / tb.samples_per_s
                             if tb.samples_per_s else None}}
    if tb.tokens_per_s and ta.tokens_per_s:
        out["tokens_per_s"] = {"before": tb.tokens_per_s, "after": ta.tokens_per_s,
                               "ratio": ta.tokens_per_s / tb.tokens_per_s}
    return out
