"""Every section of an analysis in the terminal: the run's (terminal.render: headline,
breakdown, overlap, model, parallelisms, what-ifs, findings), then what the trace holds
beside its iterations (document.extras): the collectives some rank waited in too long, the
memory, the FLOPs, and a windowed recording's window and whole run."""

from __future__ import annotations

from typing import Any

from gputrace.analyzers import Analysis


def render_all(a: Analysis, more: dict[str, Any], rank: int | None = None) -> None:
    """Print every section of `a` with its extras `more` (document.extras of the same
    trace and rank)."""
    from gputrace.analyzers.extras.flops import line as flops_line
    from gputrace.analyzers.extras.memory import memory_line
    from gputrace.analyzers.findings.findings_memory import memory_findings
    from gputrace.report.solo import one_process
    from gputrace.report.terminal import render
    from gputrace.report.window import render_window

    advised = render(a, rank)
    for h in more["hangs"]["collectives"]:
        print(f"Hang (over {more['hangs']['threshold_s']:g} s in a collective): "
              f"{h['message']}")
    line = memory_line(more["memory"], rank if rank is not None else a.main.rank)
    if line:
        print(line)
    for f in memory_findings(more["memory"]):
        print(f"  {f.severity:>8}  {f.message}")
    if flops_line(more["flops"]):
        print(flops_line(more["flops"], advise_probe=not advised))
    if "window" in more:
        render_window(more, one=one_process(a))
