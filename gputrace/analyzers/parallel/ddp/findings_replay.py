"""Findings that follow from a rank's spans and from the what-if replay, and the agreement of
every recommendation with what the replay predicts."""

from __future__ import annotations

import numpy as np

from gputrace.analyzers.core import frame as fr
from gputrace.analyzers.core.steps import RankSteps
from gputrace.analyzers.findings.rules import Finding
from gputrace.analyzers.parallel import whatif_bands
from gputrace.analyzers.parallel.ddp.replay import MIB, Replay

# pageable copies under this share of the iterations' time are not worth a finding (a few
# KB copied from a Python scalar); from PAGEABLE_HIGH they are a high one
PAGEABLE_SHARE, PAGEABLE_HIGH = 0.01, 0.10


def _extra_findings(sp: fr.Spans, rs: RankSteps) -> list[Finding]:
    out = []
    memcpy = sp.of("memcpy") | sp.of("h2d")
    pageable = np.flatnonzero(memcpy & sp.kind_is("src", "pageable"))
    t_iter = float((rs.iterations.end - rs.iterations.start).sum())
    took = float((sp.end[pageable] - sp.start[pageable]).clip(0).sum())
    share = took / t_iter if t_iter > 0 else 0.0
    if pageable.size and share >= PAGEABLE_SHARE:
        b = float(np.nansum(sp.nbytes[pageable]))
        out.append(Finding(
            "h2d_pageable", "high" if share >= PAGEABLE_HIGH else "moderate",
            f"{len(pageable)} host-to-device copies ({b / 1e6:.1f} MB, {took / 1e9:.3f} s, "
            f"{share:.0%} of the iterations' time) come from pageable memory, which copies "
            "slower than pinned: use DataLoader(pin_memory=True)."))
    return out


def _replay_findings(rp: Replay | None, world: int) -> list[Finding]:
    """The bucket size the replay finds fastest at the run's own size, when it saves >= 5%."""
    if rp is None or world < 2:
        return []
    own = [o for o in rp.outcomes if o.scenario.gpus == world and o.scenario.bandwidth_x == 1
           and o.scenario.bucket_bytes is not None and o.withheld is None]
    if not own:
        return []
    best = min(own, key=lambda o: o.t_iter)
    gain = 1 - best.t_iter / rp.measured_t_iter
    if gain < 0.05:
        return []
    what = "one bucket" if best.scenario.bucket_bytes == float("inf") else \
        f"DDP(bucket_cap_mb={best.scenario.bucket_bytes / MIB:g})"
    return [Finding("what_if_buckets", "moderate",
                    f"Replay: {what} ({best.buckets} units) would take "
                    f"{best.t_iter * 1e3:.1f} ms per iteration instead of "
                    f"{rp.measured_t_iter * 1e3:.1f} ms ({-gain:+.0%}), exposing "
                    f"{best.exposed_s * 1e3:.1f} ms of comm after backward"
                    f"{whatif_bands.said(rp.kind(best))}.")]


REPLAY_SAYS = " The what-if replay shows what other bucket sizes or a faster link would change."


def _replay_says(rp: Replay | None, world: int) -> str:
    """What the what-if replay of this run shows, in one sentence: only the scenarios it
    gives figures for."""
    shown = [o.scenario for o in rp.outcomes if o.withheld is None] if rp is not None else []
    what = [w for w, ok in (
        ("other bucket sizes", any(s.bucket_bytes is not None for s in shown)),
        ("a faster link", any(s.bandwidth_x > 1 for s in shown)),
        ("a slower link", any(s.bandwidth_x < 1 for s in shown)),
        ("more GPUs", any(s.gpus > max(world, 1) for s in shown))) if ok]
    if what[:2] == ["other bucket sizes", "a faster link"]:
        return REPLAY_SAYS
    if rp is None:
        return ""
    if not what:
        return " The what-if replay gives no figure for this run (its section says why)."
    told = ", ".join(what[:-1]) + (" or " if len(what) > 1 else "") + what[-1]
    missing = [w for w in ("other bucket sizes", "a faster link") if w not in what]
    return (f" The what-if replay shows what {told} would change; it does not predict "
            f"{' or '.join(missing)} for this run (its section says why).")


def _agree(findings: list[Finding], rp: Replay | None, world: int) -> list[Finding]:
    """A finding that recommends a change cites the replay's prediction for it, and does not
    recommend what the replay says would not help; one that points to the replay names only
    what the replay shows."""
    out = []
    for f in findings:
        if f.id == "comm_exposed" and REPLAY_SAYS in f.message:
            f = Finding(f.id, f.severity,
                        f.message.replace(REPLAY_SAYS, _replay_says(rp, world)))
        if f.id == "comm_tail" and rp is not None:
            own = [o for o in rp.outcomes if o.scenario.gpus == max(world, 2)
                   and o.scenario.bandwidth_x == 1 and o.scenario.bucket_bytes is not None
                   and o.withheld is None]
            best = min(own, key=lambda o: o.t_iter) if own else None
            if best is not None:
                head = f.message.split(": a smaller last bucket")[0]
                if best.t_iter < 0.98 * rp.measured_t_iter:
                    msg = (f"{head}: smaller buckets would shorten it (replay: "
                           f"{best.scenario.label}, {best.t_iter * 1e3:.1f} ms against "
                           f"{rp.measured_t_iter * 1e3:.1f} ms measured"
                           f"{whatif_bands.said(rp.kind(best))}).")
                else:
                    msg = (f"{head}; the replay finds no bucket size that shortens the "
                           f"iteration (best: {best.scenario.label}, {best.t_iter * 1e3:.1f} "
                           f"ms against {rp.measured_t_iter * 1e3:.1f} ms measured"
                           f"{whatif_bands.said(rp.kind(best))}).")
                f = Finding(f.id, f.severity, msg)
        out.append(f)
    return out
