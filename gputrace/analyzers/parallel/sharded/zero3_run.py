"""ZeRO-3's stage3_prefetch_bucket_size and stage3_max_live_parameters as what-ifs of a
sharded run: the recorded fetches of each analyzed iteration replayed under DeepSpeed's rule
(zero3_fetch) at other settings, against the same replay at the run's own; a parameter
all-gather's cost fitted on the run's."""

from __future__ import annotations

import math

import numpy as np

from gputrace.analyzers.findings.sanity import far_off, fit_too_small
from gputrace.analyzers.parallel.sharded import shardsim as sim
from gputrace.analyzers.parallel.sharded import zero3_fetch as zf
from gputrace.analyzers.parallel.sharded import zero_whatif as zw
from gputrace.analyzers.parallel.sharded.shardinputs import Inputs, small_calls
from gputrace.analyzers.parallel.sharded.shardtimeline import Waits
from gputrace.analyzers.parallel.sharded.shardwhatif import WhatIf, mean_ci

KEYS = ("stage3_prefetch_bucket_size", "stage3_max_live_parameters")
CPU = ("on the CPU, a prefetched gather beside compute shares the cores with it: both take "
       "longer than alone (over gloo on 2 cores, 0.5 MB gathers beside the forward took 4 ms "
       "against 2.5 ms alone), which the replay does not give: more prefetch is predicted to "
       "hide more than it does there (bench/README.md, whatif_ds.py --stages 3)")
DEFAULTS = {KEYS[0]: 50_000_000, KEYS[1]: 1_000_000_000}     # DeepSpeed's


def fetch_what_ifs(tls: list[sim.Timeline], facts: dict, si: Inputs,
                   arrive: np.ndarray | None, sel: np.ndarray, engine: dict,
                   measured: float, assumptions: list[str], world: int,
                   on_cpu: bool = False) -> list[WhatIf]:
    """stage3_prefetch_bucket_size (none, DeepSpeed's default, and the sizes
    zero_whatif.sizes gives against the model's gathered elements) and
    stage3_max_live_parameters (its default and those sizes), or both withheld with the
    reason."""
    now = {k: engine.get(k) for k in (*KEYS, "stage3_max_reuse_distance")}
    cr = si.cr
    gat = np.isin(np.array(facts["role"]), ("unshard", "reshard_gather"))
    inside = np.isin(facts["it"], sel)
    rows = facts["rows"][gat & inside]
    ks = [int(k) for k in sel.tolist() if (facts["it"] == k).any()]   # tls' iterations
    # the parameters' bytes per iteration reach MIN_FIT_BYTES (sanity.fit_too_small), in
    # calls of a layer each where prefetch is short
    per_it = float(np.nansum(cr.nbytes[rows])) / max(len(ks), 1)
    cost = None if fit_too_small(per_it) else zw.fit(
        facts["svc"][gat & inside], cr.nbytes[rows],
        *small_calls(si, arrive, sel, "all_gather"), least=0.0)
    why = None
    runs: list[list[zf.Fetch]] = []
    if not all(isinstance(v, (int, float)) for v in now.values()):
        why = "the recording does not hold the engine's ZeRO-3 prefetch settings"
    elif not si.fetch:
        why = ("the recording holds no ZeRO-3 fetches (`zero3.fetch` spans), the trace "
               "DeepSpeed prefetches along")
    elif cost is None:
        why = fit_too_small(per_it) or \
            "no cost per call and per byte fitted on the parameter all-gathers"
    else:
        waits = _gather_waits(si, facts, gat, arrive)
        for k in ks:
            m = np.flatnonzero(si.fetch_it == k)
            m = m[np.argsort(si.fetch_start[m], kind="stable")]
            runs.append(zf.fetches_of(si.fetch_start[m], si.fetch_end[m],
                                      [si.fetch[j] for j in m], waits))
        why = _unlike(runs, ks, _rule(now), facts, gat)
    if why is not None:
        return [WhatIf(k, *[math.nan] * 5, {k: None}, why)   # type: ignore[arg-type]
                for k in KEYS]
    assert cost is not None
    elem = int(engine.get("element_size") or 4)
    base = _rule(now)

    def replayed(rule: zf.Rule) -> tuple[list[tuple[float, float, float]], int]:
        """Each iteration's replay under `rule`, and its gathers per iteration."""
        plans = [zf.plan(f, rule) for f in runs]
        return ([zf.replay(f, p, elem, world, cost.alpha_s, cost.beta_s)
                 for f, p in zip(runs, plans, strict=True)],
                round(float(np.mean([zf.gathered(p) for p in plans]))))

    old, _ = replayed(base)
    ex = [float(np.sum(facts["exposed"][inside & (facts["it"] == k)])) / 1e9 for k in ks]
    sv = [float(np.sum(facts["svc"][inside & (facts["it"] == k)])) for k in ks]
    total = zf.elements(runs[0])
    out = []
    for key in KEYS:
        cur = int(now[key])   # type: ignore[arg-type]
        tries = sorted(set(zw.sizes(cur, total)) | ({DEFAULTS[key]} - {cur}) |
                       ({0} if key == KEYS[0] and cur > 0 else set()))
        for c in tries:
            rule = zf.Rule(c, base.live, base.reuse) if key == KEYS[0] else \
                zf.Rule(base.prefetch, c, base.reuse)
            new, n = replayed(rule)
            none = "no prefetch, " if key == KEYS[0] and c == 0 else ""
            label = f"{key}={c:.3g} ({none}{n} all-gather{'' if n == 1 else 's'})"
            knobs: dict[str, object] = {key: c, "gathers": n}
            m, lo, hi = mean_ci(np.array([tl.t_iter + a[0] - b[0]
                                          for tl, a, b in zip(tls, new, old, strict=True)]))
            far = far_off(m, measured)
            if far:
                out.append(WhatIf(label, *[math.nan] * 5, knobs, far))   # type: ignore[arg-type]
                continue
            d = [(e + a[1] - b[1], s + a[2] - b[2])
                 for e, s, a, b in zip(ex, sv, new, old, strict=True)]
            out.append(WhatIf(label, m, lo, hi, float(np.mean([x[0] for x in d])),
                              float(np.mean([x[1] for x in d])), knobs))
    assumptions.extend(zf.ASSUMPTIONS)
    if on_cpu:
        assumptions.append(CPU)
    assumptions.append(f"a parameter all-gather costs {cost.alpha_s * 1e3:.2f} ms per call + "
                       f"{cost.beta_s * 1e9:.2f} ms per MB ({cost.how})")
    return out


def _rule(now: dict) -> zf.Rule:
    return zf.Rule(int(now[KEYS[0]]), int(now[KEYS[1]]), int(now["stage3_max_reuse_distance"]))


def _unlike(runs: list[list[zf.Fetch]], ks: list[int], rule: zf.Rule, facts: dict,
            gat: np.ndarray) -> str | None:
    """Why the rule replayed at the run's settings is not the run (a count of gathers per
    iteration that differs), or None."""
    for k, f in zip(ks, runs, strict=True):
        n = zf.gathered(zf.plan(f, rule))
        got = int(np.sum(gat & (facts["it"] == k)))
        if n != got:
            return (f"DeepSpeed's fetch rule replayed on the recorded fetches gives {n} "
                    f"parameter all-gathers in an iteration where the run made {got}: the "
                    "recording does not follow the rule as replayed")
    return None


def _gather_waits(si: Inputs, facts: dict, gat: np.ndarray, arrive: np.ndarray | None
                  ) -> Waits:
    """The intervals the job stood still for its parameter all-gathers: its waits on them,
    a synchronous one from the last rank's arrival (before it: a slower peer's pace)."""
    cr = si.cr
    rows = facts["rows"][gat]
    arr = (si.start if arrive is None else arrive)[rows]
    waited = cr.wait_s[rows] >= 0
    sync = ~cr.is_async[rows] & ~waited
    return Waits(np.concatenate([cr.wait_s[rows][waited], arr[sync]]),
                  np.concatenate([cr.wait_e[rows][waited], si.end[rows][sync]]))
