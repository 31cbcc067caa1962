"""`analyze --json` keys for collectives (added beside the stable keys): `collectives` (per
kind, per iteration, and per parallelism within a kind), `sharded` (FSDP units, Cases,
what-ifs), `comm_missing`, and `parallelism` (the run's dimensions beyond data parallelism:
their degrees, tensor_parallel, pipeline, expert_parallel)."""

from __future__ import annotations

import math
from typing import Any

from gputrace.analyzers import RankAnalysis
from gputrace.analyzers.parallel.whatif_bands import band_keys, kind_of_label


def _num(x: float | None) -> float | None:
    if x is None or (isinstance(x, float) and (math.isnan(x) or math.isinf(x))):
        return None
    return float(x)


def collectives_dict(ra: RankAnalysis) -> dict[str, Any]:
    c = ra.collectives
    kinds: dict[str, dict[str, Any]] = {}
    for k in c.kinds:   # a kind's few-byte collectives: counted in it, and under `small`
        figs = {"count": k.count, "bytes": k.nbytes, "bytes_out": k.bytes_out,
                "time_s": k.time_s, "exposed_s": k.exposed_s}
        d = kinds.setdefault(k.kind, {**dict.fromkeys(figs, 0.0), "gradient": False})
        for key, v in figs.items():
            d[key] = d[key] + v
        d["gradient"] = d["gradient"] or k.gradient
        if k.small:
            d["small"] = dict(figs)
        if k.dim:   # which parallelism they serve (analyzers.parallel.classify)
            par = d.setdefault("parallelism", {}).setdefault(k.dim, dict.fromkeys(figs, 0.0))
            for key, v in figs.items():
                par[key] = par[key] + v
            if k.why and k.why not in par.setdefault("why", []):   # `other`: why none
                par["why"].append(k.why)
    return {"recorded": c.recorded, "in_iterations": c.in_iterations,
            "strategy": c.sharded or ("ddp" if any(k.gradient for k in c.kinds) else None),
            "group_sizes": list(c.group_sizes), "small_below_bytes": c.small_below,
            "exposed_s": c.exposed_s, "kinds": kinds}


def sharded_dict(ra: RankAnalysis) -> dict[str, Any] | None:
    sh = ra.sharded
    if sh is None:
        return None
    return {
        "strategy": sh.strategy, "world_size": sh.world, "headline": sh.headline(),
        "per_iteration": dict(sh.per_iteration), "kinds": dict(sh.kinds),
        "exposed": dict(sh.exposed), "cases": dict(sh.cases),
        "exposed_units": {k: list(v) for k, v in sh.exposed_units.items()},
        "prefetch": dict(sh.prefetch), "reshard_after_forward": sh.reshard_after_forward,
        "settings": sh.settings.as_dict() if sh.settings is not None else None,
        "baseline_t_iter": sh.baseline_t_iter, "baseline_error": sh.baseline_error,
        "assumptions": list(sh.assumptions),
        "units": [{"unit": u.unit, "name": u.name, "role": u.role, "kind": u.kind,
                   "count": u.count, "bytes": u.nbytes, "start_s": u.start_s,
                   "end_s": u.end_s, "duration_s": u.duration_s, "exposed_s": u.exposed_s,
                   "prefetched": u.prefetched} for u in sh.units],
        "what_if": [{"label": w.label, "t_iter": _num(w.t_iter), "t_iter_low": _num(w.low),
                     "t_iter_high": _num(w.high), "exposed_s": _num(w.exposed_s),
                     "comm_s": _num(w.comm_s), **w.knobs, "withheld": w.withheld,
                     **band_keys(kind_of_label(w.label))}
                    for w in sh.what_if],
    }


def parallelism_dict(ra: RankAnalysis) -> dict[str, Any] | None:
    """The run's dimensions and, where it has them, each one's section (None: plain data
    parallelism or one process)."""
    from gputrace.analyzers.parallel import tp
    from gputrace.analyzers.parallel.ep import ep
    from gputrace.analyzers.parallel.pp import pp

    if not ra.dimensions:
        return None
    out: dict[str, Any] = {"dimensions": ra.dimensions,
                           "degrees": dict(ra.degrees),
                           "groups": dict(ra.groups),
                           "terms": {k: ra.breakdown[k].mean for k in ("t_tp", "t_pp", "t_ep",
                                                                       "t_cp")
                                     if k in ra.breakdown}}
    if "tp" in ra.dims:
        out["tensor_parallel"] = tp.as_dict(ra.dims["tp"])
    if "pp" in ra.parallel:
        out["pipeline"] = pp.as_dict(ra.parallel["pp"])
    if "ep" in ra.dims:
        out["expert_parallel"] = ep.as_dict(ra.dims["ep"], ra.parallel.get("ep"))
    return out
