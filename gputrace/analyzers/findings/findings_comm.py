"""Findings about collectives: a multi-rank trace with none recorded, a sharded (FSDP) run's
exposed all-gathers and reduce-scatters and the what-if that would help, collectives that
are not gradient units."""

from __future__ import annotations

from typing import Any

from gputrace.analyzers.core.collectives import PARALLEL
from gputrace.analyzers.findings.rules import Finding
from gputrace.analyzers.parallel import whatif_bands


def shd_findings(p: Any, missing: str | None) -> list[Finding]:
    """`p`: a rank's part (RankPart); `missing`: why no comm figure can be given."""
    out: list[Finding] = []
    if missing:
        out.append(Finding("comm_missing", "high", missing + "."))
        return out
    sh = p.sharded
    if sh is not None:
        t_iter = sh.model.measured_t_iter
        exp = sh.exposed["total_s"]
        sev = "high" if t_iter and exp > 0.2 * t_iter else \
            "moderate" if t_iter and exp > 0.05 * t_iter else "info"
        parts = []
        if sh.exposed_units["forward"]:
            parts.append(f"forward all-gathers of unit{'s' if len(sh.exposed_units['forward']) > 1 else ''} "
                         f"{_list(sh.exposed_units['forward'])} waited on "
                         f"({sh.exposed['forward_s'] * 1e3:.1f} ms)")
        if sh.exposed_units["backward"]:
            parts.append(f"backward re-gathers / reduce-scatters of unit"
                         f"{'s' if len(sh.exposed_units['backward']) > 1 else ''} "
                         f"{_list(sh.exposed_units['backward'])} waited on "
                         f"({sh.exposed['backward_s'] * 1e3:.1f} ms)")
        out.append(Finding(
            "fsdp_exposed", sev,
            f"{sh.headline()} ({exp / t_iter:.0%} of the iteration)" if t_iter else
            sh.headline()) if not parts else Finding(
            "fsdp_exposed", sev, f"{sh.headline()}: " + "; ".join(parts) + "."))
        best = min((w for w in sh.what_if if w.withheld is None), key=lambda w: w.t_iter,
                   default=None)
        if best is not None and t_iter and best.t_iter < 0.95 * t_iter and \
                not best.label.startswith("link"):
            out.append(Finding(
                "fsdp_what_if", "moderate",
                f"Replay: {best.label} would take {best.t_iter * 1e3:.1f} ms per iteration "
                f"instead of {t_iter * 1e3:.1f} ms ({best.t_iter / t_iter - 1:+.0%})"
                f"{whatif_bands.said(whatif_bands.kind_of_label(best.label))}."))
    # the other dimensions' collectives have their own sections (analyzers.parallel)
    other = [k for k in p.collectives.kinds if not k.gradient and k.dim not in PARALLEL]
    if other and sh is None:
        out.append(Finding(
            "other_collectives", "info",
            "Collectives besides the gradient all-reduce, per iteration: " + "; ".join(
                (f"{k.kind} x{k.count:.3g} of a few bytes ({k.nbytes:.0f} B: a norm, a "
                 "flag, not gradients" if k.small else
                 f"{k.kind} x{k.count:.3g} ({k.nbytes / 1e6:.2f} MB")
                + f", {k.time_s * 1e3:.1f} ms, {k.exposed_s * 1e3:.1f} ms exposed)"
                for k in other)
            + "; not part of the gradient model."))
    return out


def _list(us: list[int]) -> str:
    return ", ".join(str(u) for u in us)
