"""The stable `analyze --json` document (DESIGN.md): keys are added, never renamed."""

from __future__ import annotations

import math
from typing import Any

from gputrace.analyzers import Analysis, RankAnalysis
from gputrace.analyzers.core.outliers import Outlier
from gputrace.analyzers.findings.invariants import INVARIANTS
from gputrace.analyzers.parallel.ddp.replay import Replay
from gputrace.analyzers.parallel.whatif_bands import band_keys
from gputrace.report.goodput import goodput_dict, job_dict
from gputrace.report.json_comm import collectives_dict, parallelism_dict, sharded_dict

FORMAT = "gputrace-analysis"
VERSION = 1


def _num(x: float | None) -> float | None:
    if x is None or (isinstance(x, float) and (math.isnan(x) or math.isinf(x))):
        return None
    return float(x)


def rank_dict(ra: RankAnalysis) -> dict[str, Any]:
    m = ra.model
    sp = ra.speedup
    bw = ra.bandwidth
    return {
        "iterations": {"count": ra.iterations, "warmup_skipped": ra.warmup_skipped,
                       "analyzed": ra.analyzed, "flops_left_out": ra.flops_left_out,
                       "synthetic": ra.synthetic_iterations},
        "breakdown": {k: {"mean": s.mean, "std": s.std} for k, s in ra.breakdown.items()},
        "overlap": {"comm": dict(ra.comm), "io": dict(ra.io)},
        "throughput": ra.throughput.as_dict() if ra.throughput is not None else None,
        "model": {
            "strategy": m.strategy, "case": m.case, "C": m.C, "C_unit": m.C_unit,
            "equation": m.equation, "predicted_t_iter": m.predicted_t_iter,
            "measured_t_iter": m.measured_t_iter, "relative_error": m.relative_error,
            "io_pipelined": m.io_pipelined, "t_io_pipelined": _num(m.t_io_pipelined),
            "notes": list(m.notes),
            "eq7_t_iter": _num(m.eq7_t_iter), "t_b_first": _num(m.t_b_first),
            "comm_span": _num(m.comm_span),
        },
        "units": [{"index": u.index, "layers": list(u.layers) if u.layers else None,
                   "bytes": _num(u.nbytes), "ready_s": u.ready_s, "start_s": u.start_s,
                   "end_s": u.end_s, "duration_s": u.duration_s, "hidden": u.hidden,
                   "hidden_fraction": u.hidden_fraction, "kind": u.kind} for u in m.units],
        "speedup": {
            "equation": sp.equation, "measured_world_size": sp.world_size,
            "gradient_bytes": sp.grad_bytes,
            "allreduce_efficiency": _num(sp.allreduce_efficiency),
            "allreduce_efficiency_withheld": sp.allreduce_efficiency_withheld,
            "link_bytes_per_s": _num(sp.link_bytes_per_s),
            "assumptions": list(sp.assumptions),
            "points": [{"gpus": p.gpus, "speedup": _num(p.speedup),
                        "efficiency": _num(p.efficiency), "t_iter": _num(p.t_iter),
                        "t_comm": _num(p.t_comm), "withheld": p.withheld} for p in sp.points],
            "unavailable": sp.unavailable, "shared": sp.shared,
        },
        "bandwidth": {} if bw is None else {
            "window_s": bw.window_s,
            "disk_bytes_per_iter": _num(bw.disk_bytes_per_iter),
            "cache_bytes_per_iter": _num(bw.cache_bytes_per_iter),
            "links": [{"name": link.name, "bytes": link.bytes, "bytes_per_s": link.bytes_per_s,
                       "peak_bytes_per_s": _num(link.peak_bytes_per_s),
                       "fraction_of_peak": _num(link.fraction_of_peak)} for link in bw.links],
        },
        "findings": [{"id": f.id, "severity": f.severity, "message": f.message}
                     for f in ra.findings],
        "comm_wait_s": _num(ra.comm_wait_s),
        "comm_transfer_s": _num(ra.comm_transfer_s),
        "what_if": _what_if(ra.replay),
        "what_if_unavailable": ra.replay_unavailable,
        "host": ra.host,
        "comm_missing": ra.comm_missing,
        "collectives": collectives_dict(ra),
        "sharded": sharded_dict(ra),
        "parallelism": parallelism_dict(ra),
        "withheld": dict(ra.withheld),
        "device_busy": dict(ra.device_busy) if ra.device_busy is not None else None,
        "recompute": ra.recompute.as_dict() if ra.recompute is not None else None,
        "goodput": goodput_dict(ra),
    }


def _what_if(rp: Replay | None) -> dict[str, Any] | None:
    if rp is None:
        return None

    def bucket(b: float | None) -> dict[str, Any]:
        if b is None:
            return {"bucket_rule": "measured", "bucket_bytes": None}
        if math.isinf(b):
            return {"bucket_rule": "one", "bucket_bytes": None}
        return {"bucket_rule": "cap", "bucket_bytes": int(b)}

    return {
        "method": "replay",
        "comm_cost": {"alpha_s": rp.cost.alpha_s, "beta_bytes_per_s": rp.cost.beta_bytes_per_s,
                      "fitted_at_gpus": rp.cost.world, "source": rp.cost.source,
                      "cpu_s_per_byte": rp.cost.cpu_s_per_byte,
                      "wire_bytes_per_s": _num(rp.cost.wire_bytes_per_s)},
        "contention_s": rp.contention_s,
        "backward_end_s": rp.backward_end_s, "measured_t_iter": rp.measured_t_iter,
        "baseline_t_iter": rp.baseline_t_iter, "baseline_error": rp.baseline_error,
        "layers_known": rp.layers_known, "assumptions": list(rp.assumptions),
        "scenarios": [{"label": o.scenario.label, "gpus": o.scenario.gpus,
                       "bandwidth_x": o.scenario.bandwidth_x, **bucket(o.scenario.bucket_bytes),
                       "buckets": o.buckets, "comm_s": _num(o.comm_s),
                       "exposed_s": _num(o.exposed_s), "t_iter": _num(o.t_iter),
                       "speedup": _num(o.speedup),
                       "t_iter_low": _num(o.low), "t_iter_high": _num(o.high),
                       "reference_t_iter": _num(o.reference_t_iter),
                       "extrapolated": o.extrapolated, "withheld": o.withheld,
                       **band_keys(rp.kind(o))}
                      for o in rp.outcomes],
    }


NO_BATCH = ("the batch is not known: no input tensor was seen at the model's outermost "
            "forward (give --batch-size N)")


def to_dict(a: Analysis, rank: int | None = None) -> dict[str, Any]:
    main = a.ranks[rank] if rank is not None else a.main
    doc: dict[str, Any] = {"format": FORMAT, "version": VERSION}
    doc.update(rank_dict(main))
    doc["rank"] = main.rank
    doc["slowest_rank"] = a.slowest_rank
    doc["world_size"] = a.world_size
    doc["ranks"] = {str(r): rank_dict(ra) for r, ra in sorted(a.ranks.items())}
    doc["throughput"] = {**(doc["throughput"] or {}), "job": a.throughput.as_dict()
                         if a.throughput is not None else None,
                         "unavailable": None if main.throughput is not None else NO_BATCH}
    if doc["goodput"] is not None:
        doc["goodput"] = {**doc["goodput"], "job": job_dict(a)}
    doc["hosts"] = _hosts(a)
    doc["clock"] = _clock(a)
    doc["slowest"] = _outlier(a.slowest_why) if a.slowest_why else None
    doc["outliers"] = [_outlier(o) for o in a.outliers]
    doc["checks"] = {"invariants": dict(INVARIANTS),
                     "violated": [c.as_dict() for c in a.checks]}
    return doc


def _hosts(a: Analysis) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for r, ra in sorted(a.ranks.items()):
        out.setdefault(ra.host, []).append(r)
    return out


def _clock(a: Analysis) -> dict[str, Any] | None:
    c = a.clock
    if c is None:
        return None
    return {"reference_host": c.reference, "applied": c.applied,
            "method": "median over shared comm units of the difference of each host's "
                      "earliest end, within the causal bounds",
            "hosts": {h: {"ranks": hc.ranks, "offset_s": hc.offset_s,
                          "uncertainty_s": hc.uncertainty_s, "spread_s": hc.spread_s,
                          "matched_units": hc.matched,
                          "bounds_s": list(hc.bounds_s) if hc.bounds_s else None,
                          "note": hc.note}
                      for h, hc in sorted(c.hosts.items())}}


def _outlier(o: Outlier) -> dict[str, Any]:
    return {"rank": o.rank, "host": o.host, "t_iter_s": o.t_iter_s, "excess_s": o.excess_s,
            "term": o.term, "term_excess_s": o.term_excess_s, "why": o.why}
