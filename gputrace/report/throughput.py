"""The throughput's words: the headline's samples/s and the line under Table V."""

from __future__ import annotations

from typing import Any

from rich.markup import escape

from gputrace.report.goodput import run_samples_per_s


def rate_text(x: float) -> str:
    """A rate as people read it: 30,885 or 12.3."""
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def throughput_line(a: Any, ra: Any) -> str:
    """How fast: this rank's samples (tokens) per second and where its batch came from, and
    the job's over its data-parallel replicas."""
    from gputrace.report.json import NO_BATCH

    t = ra.throughput
    if t is None:
        return f"[dim]throughput: {NO_BATCH}[/]"
    tok = f", {rate_text(t.tokens_per_s)} tokens/s" if t.tokens_per_s else ""
    fw = (f": {t.forwards:.3g} forwards of {t.samples / t.forwards:.4g}"
          if t.forwards != 1 else "")
    on = "rank" if a.world_size > 1 else "process"
    out = (f"throughput: {rate_text(t.samples_per_s)} samples/s{tok} on this {on} "
           f"({t.samples:.4g} samples per iteration{fw}; batch from {escape(t.source)})")
    run = run_samples_per_s(ra)
    if run is not None:
        out += f"; over the whole run {rate_text(run)} samples/s (every training step over the wall time)"
    j = a.throughput
    if j is not None and a.world_size > 1:
        jt = f", {rate_text(j.tokens_per_s)} tokens/s" if j.tokens_per_s else ""
        out += (f"; the job: {rate_text(j.samples_per_s)} samples/s{jt} over {j.replicas} "
                f"data-parallel replica{'s' if j.replicas != 1 else ''}")
    return out
