"""What is read from the trace's rows beside the analyzers' results: a windowed
recording's `window` and `run` (with its `window_missed` finding), `memory` (with its
findings), `flops` (with its finding) and `hangs` (the collectives some rank waited in too
long, each a finding). report.document puts them in the `analyze --json` document and the
report's charts."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from gputrace.analyzers.extras.memory import COLUMNS as _MEMORY_COLUMNS


@dataclass(frozen=True)
class Beside:
    """What extras() read for one rank, kept with the analysis (Analysis.beside) so that
    the terminal, `--json`, the API and the report read the one result."""

    rank: int                                  # the rank it was read for
    doc: dict[str, Any]                        # `window` and `run`, `memory`, `flops`, `hangs`
    memory_rows: list[Any] | None = None       # the memory samples (the report's chart)


def beside(a: Any, rank: int | None, inputs: Sequence[str], rows: bool = False) -> Beside:
    """What is read beside the analysis `a` for `rank` (None: the rank shown), with the
    memory samples where `rows`: the one the analysis holds where it was read for that rank
    (and holds the rows asked for), else read now."""
    shown = rank if rank is not None else a.main.rank
    held = getattr(a, "beside", None)
    if isinstance(held, Beside) and held.rank == shown and \
            (not rows or held.memory_rows is not None):
        return held
    kept: list[Any] | None = [] if rows else None
    return Beside(shown, extras(a, shown, inputs, kept), kept)


def extras(a: Any, rank: int | None, inputs: Sequence[str],
           rows: list[Any] | None = None) -> dict[str, Any]:
    """`window` and `run` (a windowed recording only) and `memory` of the trace `inputs`;
    `rows`: a list that gets the memory samples read (for the chart)."""
    from gputrace.analysis.inputs import load_inputs
    from gputrace.analyzers.extras.memory import analyze_memory, empty, memory_rows
    from gputrace.analyzers.extras.window import analyze_window, window_of

    shown = rank if rank is not None else a.main.rank
    out: dict[str, Any] = {}
    table = None
    if window_of(a.metadata) is not None:
        table = load_inputs(list(inputs), quiet=True).table
        out.update(analyze_window(table, a.metadata, shown))
    full = table          # every row (a windowed recording's), else None
    if table is None:
        table = _columns(inputs)
    out["memory"] = analyze_memory(table, shown, a.metadata) if table is not None \
        else empty()
    if rows is not None and table is not None:
        rows.extend(memory_rows(table))
    from gputrace.analysis.document_flops import flops_doc

    out["flops"] = flops_doc(a, shown, inputs)
    out["hangs"] = _hangs(full, inputs)
    return out


def _hangs(table: pa.Table | None, inputs: Sequence[str]) -> dict[str, Any]:
    """`hangs`: the collectives some rank waited in too long (analyzers.extras.hangs), from
    `table` where every row was read, else the trace files' `flight` instants alone, or the
    shards of a recording not closed (killed, or still running)."""
    from gputrace.analyzers.extras import hangs
    from gputrace.trace.reader import unclosed

    if table is None and any(unclosed(p) is not None for p in inputs):
        from gputrace.analysis.inputs import load_inputs

        table = load_inputs(list(inputs), quiet=True).table
    if table is None:
        table = _read(inputs, hangs.COLUMNS, _flight)
    return hangs.as_json(hangs.find(hangs.rows_of(table)))


def _flight(b: pa.RecordBatch) -> pa.RecordBatch:
    import pyarrow.compute as pc

    return b.filter(pc.and_(pc.equal(b.column("kind").cast(pa.string()), "instant"),
                            pc.equal(b.column("cat").cast(pa.string()), "flight"))
                    .fill_null(False))


def more_findings(more: dict[str, Any]) -> list[Any]:
    """The findings of what extras() read (analyzers.Finding): the hangs', the window's,
    memory's and the FLOP count's."""
    from gputrace.analyzers.findings.findings_memory import memory_findings
    from gputrace.analyzers.findings.rules import Finding

    out = [Finding("collective_hang", "high", h["message"])
           for h in (more.get("hangs") or {}).get("collectives", [])]
    if "run" in more and more["run"]["finding"]:
        out.append(Finding("window_missed", "moderate", more["run"]["finding"]))
    if (more.get("flops") or {}).get("finding"):
        out.append(Finding("layers_below_peak", "moderate", more["flops"]["finding"]))
    return out + memory_findings(more["memory"])


def _columns(inputs: Sequence[str]) -> pa.Table | None:
    """The rows the memory analysis reads, of trace files only: the samples, and the first
    row of each rank in each batch (its rank -1 is rank 0 only where no row says 0:
    window.stored_rank), a batch at a time, read, not mapped (every row of the columns at
    once peaked at ~100 B per event of the trace beside the analysis); None for other
    inputs (imports, directories), which hold no memory samples or are read in full
    elsewhere."""
    import numpy as np
    import pyarrow.compute as pc

    def kept(b: pa.RecordBatch) -> pa.RecordBatch:
        m = pc.equal(b.column("kind").cast(pa.string()), "sample").fill_null(False)
        m = m.to_numpy(zero_copy_only=False).copy()
        m[np.unique(b.column("rank").fill_null(-(2**31)).to_numpy(), return_index=True)[1]] = True
        return b.filter(pa.array(m))

    return _read(inputs, _MEMORY_COLUMNS, kept)


def _read(inputs: Sequence[str], columns: Sequence[str],
          keep: Any) -> pa.Table | None:
    """`columns` of the trace files' rows that `keep` (a record batch's filter) keeps, a
    batch at a time; None for other inputs, or a file that cannot be read (truncated)."""
    parts = []
    for p in inputs:
        if not (p.endswith(".arrow") and os.path.isfile(p)):
            return None
        try:
            with pa.OSFile(p) as src:
                r = pa.ipc.open_file(src)
                idx = [r.schema.get_field_index(c) for c in columns]
                r = pa.ipc.open_file(src, options=pa.ipc.IpcReadOptions(
                    included_fields=idx))
                parts.append(pa.Table.from_batches(
                    [keep(r.get_batch(i)) for i in range(r.num_record_batches)], r.schema))
        except (OSError, pa.ArrowException):
            return None        # a truncated file: no such section rather than a full read
    return pa.concat_tables(parts, promote_options="permissive") if parts else None
