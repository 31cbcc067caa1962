"""Plain-language findings of the parallelisms beyond data parallelism, each with the
figures behind it: exposed tensor-parallel comm and what another degree would give, a
pipeline bubble beyond its schedule's theory and the best replayed change, an imbalance of
expert-parallel all-to-alls."""

from __future__ import annotations

from typing import Any

from gputrace.analyzers.findings.rules import Finding
from gputrace.analyzers.parallel import whatif_bands as wb


def _sev(share: float) -> str:
    return "high" if share >= 0.25 else "moderate" if share >= 0.10 else "info"


def findings(dims: dict[str, Any], parallel: dict[str, Any], t_iter: float) -> list[Finding]:
    out: list[Finding] = []
    if not t_iter > 0:
        return out
    tp = dims.get("tp")
    if tp is not None and tp.exposed_s > 0:
        share = tp.exposed_s / t_iter
        best = min((w for w in tp.what_if if w.degree != tp.degree), default=None,
                   key=lambda w: w.t_iter)
        out.append(Finding(
            "tp_exposed", _sev(share),
            f"Tensor-parallel comm (TP {tp.degree}) stands in the iteration's way: "
            f"{tp.exposed_s * 1e3:.1f} ms of {t_iter * 1e3:.1f} ms ({share:.0%}) in "
            f"{tp.count:.3g} collectives per iteration, each on the critical path"
            + (f"; at TP {best.degree} the TP-degree model gives {best.t_iter * 1e3:.1f} ms "
               f"({best.t_iter / t_iter - 1:+.0%}"
               f"{wb.said(wb.kind_of_degree(best.degree, tp.degree))})"
               if best is not None else "")
            + "."))
    pl = parallel.get("pp")
    if pl is not None:
        gap = pl.bubble - pl.theory
        best = min(pl.what_if, key=lambda w: w.t_iter, default=None)
        out.append(Finding(
            "pp_bubble", _sev(pl.bubble) if gap > 0.05 else "info",
            f"{pl.headline()[0].upper()}{pl.headline()[1:]}"
            + (f"; the stages wait for each other beyond the schedule's own bubble (stage "
               f"{pl.slowest} is the slowest)" if gap > 0.05 else "")
            + (f"; replayed, {best.what} would take {best.t_iter * 1e3:.1f} ms per "
               f"iteration ({best.t_iter / t_iter - 1:+.0%}"
               + (f"; such a what-if was measured off by {wb.text(best.band)}"
                  if best.band else "") + ")"
               if best is not None and best.t_iter < 0.97 * t_iter else "")
            + "."))
    imb = parallel.get("ep")
    tok = getattr(imb, "tokens_ratio", float("nan"))
    ratio = tok if tok == tok else imb.ratio if imb is not None else 1.0
    if imb is not None and ratio > 1.1:
        what = "receives {:.2f}x its group's mean tokens" if tok == tok else \
            "moves {:.2f}x its group's mean bytes"
        out.append(Finding(
            "ep_imbalance", "moderate" if ratio < 1.5 else "high",
            f"Expert-parallel all-to-alls are unbalanced: rank {imb.most_loaded} "
            f"{what.format(ratio)} per iteration; " + _waits(imb)))
    return out


def _waits(imb: Any) -> str:
    """Who waited in the all-to-alls for whom, as measured (the group of the most-loaded
    rank); where not measured, what the imbalance implies."""
    g = next((g for g in imb.groups if g.most_loaded == imb.most_loaded), None)
    if g is None or not g.wait_s:
        return "the others in its group wait for it in every dispatch and combine."
    each = ", ".join(f"rank {r} {w * 1e3:.1f} ms" for r, w in sorted(g.wait_s.items()))
    least = min(g.wait_s, key=lambda r: g.wait_s[r])
    why = "the others waiting for it" if least == g.most_loaded else \
        "not the others for it alone: the ranks' other work shifts who comes last"
    return (f"each rank's wait in the all-to-alls for its group's last rank to enter them, "
            f"per iteration: {each} ({why}).")
