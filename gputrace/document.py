"""The `analyze --json` document of one analysis, as the command line prints it and the
Python API returns it: the analyzers' results (report.json.to_dict), and what is read from
the trace's rows beside them: a windowed recording's `window` and `run` (with its
`window_missed` finding), and `memory`."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import pyarrow as pa

from gputrace.analyzers.memory import UNAVAILABLE


def extras(a: Any, rank: int | None, inputs: Sequence[str]) -> dict[str, Any]:
    """`window` and `run` (a windowed recording only) and `memory` of the trace `inputs`."""
    from gputrace.analyzers.memory import analyze_memory
    from gputrace.analyzers.window import analyze_window, window_of
    from gputrace.inputs import load_inputs

    shown = rank if rank is not None else a.main.rank
    out: dict[str, Any] = {}
    table = None
    if window_of(a.metadata) is not None:
        table = load_inputs(list(inputs), quiet=True).table
        out.update(analyze_window(table, a.metadata, shown))
    if table is None:
        table = _columns(inputs)
    out["memory"] = analyze_memory(table, shown) if table is not None else \
        {"rss_peak_bytes": None, "cuda": [], "ranks": {}, "unavailable": UNAVAILABLE}
    from gputrace.document_flops import flops_doc

    out["flops"] = flops_doc(a, shown, inputs)
    return out


_MEMORY_COLUMNS = ("kind", "cat", "name", "rank", "pid", "device", "value")


def _columns(inputs: Sequence[str]) -> pa.Table | None:
    """The columns the memory analysis reads, of trace files only (a second read of every
    column would double a large trace's analysis); None for other inputs (imports,
    directories), which hold no memory samples or are read in full elsewhere."""
    parts = []
    for p in inputs:
        if not (p.endswith(".arrow") and os.path.isfile(p)):
            return None
        try:
            with pa.memory_map(p) as src:
                r = pa.ipc.open_file(src)
                idx = [r.schema.get_field_index(c) for c in _MEMORY_COLUMNS]
                r = pa.ipc.open_file(src, options=pa.ipc.IpcReadOptions(
                    included_fields=idx))
                parts.append(r.read_all())
        except (OSError, pa.ArrowException):
            return None        # a truncated file: no memory line rather than a full read
    return pa.concat_tables(parts, promote_options="permissive") if parts else None


def document(a: Any, rank: int | None, inputs: Sequence[str],
             more: dict[str, Any] | None = None) -> dict[str, Any]:
    """The whole document; `more`: extras() already computed."""
    from gputrace.report.json import to_dict

    doc = to_dict(a, rank)
    more = extras(a, rank, inputs) if more is None else more
    doc.update(more)
    if more.get("flops", {}).get("finding"):
        doc["findings"].append({"id": "layers_below_peak", "severity": "moderate",
                                "message": more["flops"]["finding"]})
    if "run" in more and more["run"]["finding"]:
        doc["findings"].append({"id": "window_missed", "severity": "moderate",
                                "message": more["run"]["finding"]})
    return doc


def charts(a: Any, rank: int | None, inputs: Sequence[str]) -> tuple[Any, ...]:
    """The report's charts of what the analysis does not hold: a windowed recording's
    whole run, and each layer's efficiency where the trace has a FLOP count."""
    from gputrace.analyzers.window import window_of
    from gputrace.report.charts_flops import flops_chart

    if window_of(a.metadata) is None:
        from gputrace.document_flops import flops_doc

        more = {"flops": flops_doc(a, rank if rank is not None else a.main.rank, inputs)}
        made = [flops_chart(more["flops"])]
    else:
        from gputrace.report.charts_run import run_chart

        more = extras(a, rank, inputs)
        made = [run_chart(more), flops_chart(more["flops"])]
    return tuple(c for c in made if c is not None)
