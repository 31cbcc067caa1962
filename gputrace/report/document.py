"""The `analyze --json` document of one analysis, as the command line prints it and the
Python API returns it: the analyzers' results (report.json.to_dict) with what
analysis.extras makes beside them, and the report's charts of those (memory over one
iteration, the whole run, each layer's efficiency)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gputrace.analysis.extras import beside, more_findings


def document(a: Any, rank: int | None, inputs: Sequence[str],
             more: dict[str, Any] | None = None) -> dict[str, Any]:
    """The whole document; `more`: what lies beside it (default: the analysis' own,
    Analysis.beside, where it was made for this rank)."""
    from gputrace.report.json import to_dict

    doc = to_dict(a, rank)
    more = beside(a, rank, inputs).doc if more is None else more
    doc.update(more)
    found = [{"id": f.id, "severity": f.severity, "message": f.message}
             for f in more_findings(more)]
    doc["findings"] += found
    shown = doc.get("ranks", {}).get(str(doc.get("rank")))
    if shown is not None and shown.get("findings") is not doc["findings"]:
        shown["findings"] += found      # the findings table reads them per rank
    return doc


def page_parts(a: Any, rank: int | None, inputs: Sequence[str]
               ) -> tuple[tuple[Any, ...], list[Any]]:
    """The report's charts of what the analysis does not hold (a windowed recording's
    whole run, memory over one iteration, each layer's efficiency where the trace has a FLOP
    count) and the findings of it."""
    from gputrace.report.charts_flops import flops_chart
    from gputrace.report.charts_memory import memory_chart
    from gputrace.report.charts_run import run_chart
    from gputrace.report.solo import one_process

    held = beside(a, rank, inputs, rows=True)
    more, rows = held.doc, held.memory_rows or []
    ra = a.ranks[rank] if rank is not None else a.main
    made = [run_chart(more) if "run" in more else None,
            memory_chart(ra, rows, more["memory"], rank if rank is not None else ra.rank,
                         one_process(a)),
            flops_chart(more["flops"])]
    return tuple(c for c in made if c is not None), more_findings(more)
