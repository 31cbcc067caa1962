"""DeepSpeed ZeRO's what-ifs on a sharded run: reduce_bucket_size and overlap_comm
(zero_whatif's re-bucketed timelines, replayed by shardsim), allgather_bucket_size (the
step's gathers), and ZeRO-3's stage3_prefetch_bucket_size and stage3_max_live_parameters
(zero3_fetch's replay of the recorded fetches); each collective's cost fitted on the run's."""

from __future__ import annotations

import math

import numpy as np

from gputrace.analyzers.findings.sanity import far_off, fit_too_small
from gputrace.analyzers.parallel.sharded import shardsim as sim
from gputrace.analyzers.parallel.sharded import zero_whatif as zw
from gputrace.analyzers.parallel.sharded.shardinputs import Inputs, small_calls
from gputrace.analyzers.parallel.sharded.shardwhatif import WhatIf, mean_ci
from gputrace.analyzers.parallel.sharded.zero3_run import fetch_what_ifs


def what_ifs(tls: list[sim.Timeline], facts: dict, si: Inputs, arrive: np.ndarray | None,
             sel: np.ndarray, engine: dict, base: sim.Knobs, measured: float,
             assumptions: list[str], world: int, on_cpu: bool = False) -> list[WhatIf]:
    """DeepSpeed's reduce_bucket_size, overlap_comm, allgather_bucket_size and ZeRO-3's
    prefetch settings (analyzers.parallel.sharded.zero_whatif), each collective's cost fitted on the run's."""
    cr = si.cr
    inside = np.isin(facts["it"], sel)
    roles = np.array(facts["role"])
    red = inside & (roles == "reduce_grad")
    rows = facts["rows"][red]
    sync = bool(np.mean(~cr.is_async[rows]) >= 0.5) if rows.size else True
    cost = zw.fit(facts["svc"][red], cr.nbytes[rows],
                  *small_calls(si, arrive, sel, cr.kind[rows[0]] if rows.size else ""))
    out = []
    if cost is None and rows.size:
        why = fit_too_small(float(np.nansum(cr.nbytes[rows])) / max(len(tls), 1)) or \
            "no cost per byte fitted on the gradient reductions"
        out.append(WhatIf("reduce_bucket_size", *[math.nan] * 5,   # type: ignore[arg-type]
                          {"reduce_bucket_size": None}, why))
    for label, knobs, new, ref in zw.scenarios(tls, cost, cr.nbytes[rows], engine, sync) \
            if cost is not None else []:
        v = np.array([tl.t_iter + _total(sim.simulate(a, base)) - _total(sim.simulate(b, base))
                      for tl, a, b in zip(tls, new, ref, strict=True)])
        m, lo, hi = mean_ci(v)
        far = far_off(m, measured)
        if far:
            out.append(WhatIf(label, *[math.nan] * 5, knobs, far))   # type: ignore[arg-type]
            continue
        r = [sim.simulate(a, base) for a in new]
        out.append(WhatIf(label, m, lo, hi, float(np.mean([x.exposed_forward_s +
                                                           x.exposed_backward_s for x in r])),
                          float(np.mean([x.comm_s for x in r])), knobs))
    if out:
        assumptions.extend(zw.ASSUMPTIONS)
    if cost is not None:
        assumptions.append(f"a gradient reduction costs {cost.alpha_s * 1e3:.2f} ms per call "
                           f"+ {cost.beta_s * 1e9:.2f} ms per MB ({cost.how})")
    step = inside & (roles == "step_gather")
    g_rows = facts["rows"][step]
    g_cost = zw.fit(facts["svc"][step], cr.nbytes[g_rows],
                    *small_calls(si, arrive, sel, "all_gather"))
    n_it = max(len(tls), 1)
    for label, knobs, delta, why in (zw.gathers(engine, g_rows.size / n_it,
                                               float(np.nansum(cr.nbytes[g_rows])) / n_it,
                                               world, g_cost, _grad_bytes(tls))):
        if why is not None or delta is None:
            out.append(WhatIf(label, *[math.nan] * 5, knobs, why))   # type: ignore[arg-type]
            continue
        m, lo, hi = mean_ci(np.array([tl.t_iter + delta for tl in tls]))
        r = [sim.simulate(tl, base) for tl in tls]   # the step's gathers block: exposed
        out.append(WhatIf(label, m, lo, hi, float(np.mean([x.exposed_forward_s +
                                                           x.exposed_backward_s for x in r]))
                          + delta, float(np.mean([x.comm_s for x in r])) + delta, knobs))
    if int(engine.get("stage", 0)) == 3:
        out.extend(fetch_what_ifs(tls, facts, si, arrive, sel, engine, measured, assumptions,
                                  world, on_cpu))
    return out


def _grad_bytes(tls: list[sim.Timeline]) -> float:
    """The gradients' bytes per iteration (the recorded backward layers'), 0 unknown."""
    return float(np.mean([sum(b for _, b in tl.layers) for tl in tls])) if tls else 0.0


def _total(r: sim.Result) -> float:
    return r.forward_s + r.backward_s
